"""Real runs of small models with PyTorch (optional extra ``run``): the simulator's ground
truth. ``planner.run.model`` builds blocks of the same kinds as a ``ModelSpec`` (written the
way fused training kernels save tensors); ``planner.run.measure`` measures what a block
really keeps for backward; ``planner.run.device`` is where runs run (CPU with gloo, or CUDA
GPUs with NCCL); ``planner.run.bench`` measures one device at real model widths
(``planner calibrate --sweep``)."""
