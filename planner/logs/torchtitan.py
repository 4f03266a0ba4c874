"""torchtitan training logs as measured runs: ``recognises(text)`` and ``read(text, path)``.

Every line format is torchtitan's own, cited next to its pattern by file and line at the
commits that wrote it: the TOML-config releases v0.1.0 (f7084fc7), v0.2.0 (29624e37) and v0.2.2
(73a0e697), and b5bcd76c (the Python-config trainer, ``torchtitan/trainer.py``).

What a log states and where:
- the model: ``Building <name> <flavor> with <args>`` (the model args as a dataclass repr,
  v0.1.0-v0.2.0, or as JSON, v0.2.1-v0.2.2) or ``Building <name> <flavor>`` (b5bcd76c).
  llama3 is built from its args (torchtitan's FeedForward width rule); a llama3 or
  deepseek_v3 flavor without args is the flavor of ``planner.export.flavors``; deepseek_v3
  args must agree with that flavor field for field. ``Model ... size: N total parameters``,
  where logged, must equal the built model's parameters;
- the batch: ``Trainer is initialized with local batch size ..., global batch size ...,
  sequence length ...`` (v0.1.0-v0.2.2) or ``... tokens per DP rank, ... tokens per train
  step, ..., maximum context length ...`` (b5bcd76c);
- the degrees: ``Building device mesh with parallelism: pp=..., dp_replicate=..., dp_shard=...,
  cp=..., tp=..., ep=...[, etp=...]`` (v0.2.1 on) or ``Building N-D device mesh with [names],
  [sizes]`` (v0.1.0-v0.2.0, degrees not named are 1);
- recompute: ``Applied <mode> activation checkpointing to the model`` (none when absent);
- the pipeline: ``Using pipeline schedule <name> with <n> microbatches and <s> stages.`` and
  ``PP rank <r> is building stage_idx <i> with modules [...]``;
- precision and compilation: the Float8/MX converter lines, ``Compiling each TransformerBlock
  with torch.compile``, ``Compiling the loss function with torch.compile``, ``Async TP is
  enabled``;
- the job config dump (``Running with configs: {json}`` / ``Running with args: {dict}``, only
  with ``print_config``/``print_args``): settings no other line states;
- measurements: the per-step line ``step: N  loss: ...  memory: X GiB(P%)  tps: T  ...``.

Refused in one line: a log without the model, the batch and sequence length, the parallel
degrees or a steady-state step line; a model other than llama3 (from its args or flavor) or a
known deepseek_v3 flavor, or args or a parameter count that disagree with it; HSDP (replicas of
sharded groups); MX training and FP32 runs; the memory-budget activation checkpointing; a
pipeline schedule the planner does not run; two lines stating different values of one setting.

Step time. torchtitan's ``tps`` is the tokens its data loader read on one rank since the
previous step line (``labels.numel()`` of each micro-batch, train.py:406 at v0.2.2), over the
seconds since it, divided by the ranks that share those tokens (``cp * tp * pp``,
``non_data_parallel_size``, distributed/parallel_dims.py:660-661 at b5bcd76c;
components/metrics.py:421-424 at v0.2.2, :480-483 at b5bcd76c): the global tokens per
second per GPU. So one step takes
``global_batch * seq_len / (tps * world_size)`` seconds (b5bcd76c: tokens per train step /
(tps * world size)), averaged over the steps since the previous step line. A line's memory is
the reserved peak (``reserved_bytes.all.peak``) since the previous line; the allocator's
allocated peak is not logged.
"""

from __future__ import annotations

import ast
import math
import re
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any

from planner.errors import PlannerError
from planner.export.flavors import DEEPSEEK_V3, LLAMA3_SCALING, flavors
from planner.layout import Layout
from planner.logs import LoggedRun
from planner.logs.text import ANSI, Line, Settings, json_block, naming_the_log, streams
from planner.schedules import schedule_of
from planner.specs import ModelSpec, TrainingJob

GIB = 2**30
WARMUP_STEPS = 3  # the first steps of each start whose step lines are dropped

# --- launcher and logging prefixes -------------------------------------------------------------
# Slurm's srun --label puts the task number and ": " before each line (width-padded);
# torchrun --tee: "[<role><local_rank>]:"
# (torch/distributed/elastic/multiprocessing/tail_log.py:130, header f"[{self._name}{local_rank}]:";
# torchtitan's run_train.sh:45 (v0.2.2) passes --role rank --tee 3, so "[rank0]:").
_RANK = re.compile(r"^(?P<label>\s*\d+: )?(?P<header>\[[A-Za-z_]+\d+\]:)?")
# torchtitan/tools/logging.py:21 (v0.2.2, b5bcd76c; :19 at v0.1.0):
# "[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s"
_TITAN = re.compile(r"^\[titan\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ - \S+ - [A-Z]+ - ")

# --- the lines read ----------------------------------------------------------------------------
# components/metrics.py:461-470 (v0.2.2), :527-536 (b5bcd76c, mfu "N/A" under quantization),
# :400-408 (v0.1.0, no grad_norm): f"step: {step:2}  loss: {loss:8.5f}  grad_norm: {g:7.4f}  "
# f"memory: {max_reserved_gib:5.2f}GiB({max_reserved_pct:.2f}%)  tps: {round(tps):,}  "
# f"tflops: {tflops:,.2f}  mfu: {mfu:.2f}%"
_STEP = re.compile(
    r"^step:\s*(?P<step>\d+)\s+loss:\s*\S+\s+(?:grad_norm:\s*\S+\s+)?"
    r"memory:\s*(?P<gib>\d+\.\d+)GiB\(\d+\.\d+%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*[\d,.]+\s+mfu:\s*(?:[\d.]+%|N/A)\s*$"
)
# train.py:655 (v0.2.2), trainer.py:1022 (b5bcd76c), train.py:473 (v0.1.0, with a period):
# f"Training starts at step {self.step + 1}"
_START = re.compile(r"^Training starts at step (?P<step>\d+)\.?$")
# train.py:143-146 (v0.2.2): f"Building {name} {flavor}"
# f"with {json.dumps(asdict(args), indent=2)}" (no space before "with"); train.py:147
# (v0.1.0, v0.2.0): f"Building {name} {flavor} with {args}" (the dataclass repr);
# trainer.py:354 (b5bcd76c): f"Building {model_spec.name} {model_spec.flavor}"
_BUILD_ARGS = re.compile(r"^Building (?P<name>\S+) (?P<flavor>\S+?) ?with (?P<args>\{|\w+\(.*)$")
_BUILD_NAME = re.compile(r"^Building (?P<name>[A-Za-z]\S*) (?P<flavor>\S+)$")
# train.py:174-177 (v0.2.2), trainer.py:388-391 (b5bcd76c):
# f"Model {name} {flavor} size: {model_param_count:,} total parameters"
_PARAMS = re.compile(r"^Model (?P<name>\S+) (?P<flavor>\S+) size: (?P<n>[\d,]+) total parameters$")
# train.py:354-362 (v0.2.2; v0.1.0 :322-331 ends with a period): "Trainer is initialized with "
# f"local batch size {lbs}, global batch size {gbs}, gradient accumulation steps {ga}, "
# f"sequence length {seq_len}, total steps {steps} (warmup {warmup})"
_TRAINER_BATCH = re.compile(
    r"^Trainer is initialized with local batch size (?P<local>\d+), global batch size "
    r"(?P<global_>\d+), gradient accumulation steps (?P<ga>\d+), sequence length (?P<seq>\d+),"
)
# trainer.py:621-629 (b5bcd76c): "Trainer is initialized with {n} tokens per DP rank, "
# "{n} tokens per train step, gradient accumulation steps {ga}, maximum context length {L}, ..."
_TRAINER_TOKENS = re.compile(
    r"^Trainer is initialized with (?P<per_dp>\d+) tokens per DP rank, (?P<per_step>\d+) "
    r"tokens per train step, gradient accumulation steps (?P<ga>\d+), maximum context length "
    r"(?P<seq>\d+),"
)
# distributed/parallel_dims.py:130-134 (v0.2.2, with etp), :274-278 (b5bcd76c, no etp):
# "Building device mesh with parallelism: pp={pp}, dp_replicate={r}, dp_shard={s}, cp={cp}, "
# "tp={tp}, ep={ep}, etp={etp}"
_MESH = re.compile(r"^Building device mesh with parallelism: (?P<dims>(?:\w+=\d+(?:, )?)+)$")
# distributed/parallel_dims.py:73 (v0.1.0), :107 and :158 (v0.2.0):
# f"Building {len(dims)}-D device mesh with {names}, {dims}" (only degrees above 1 named)
_MESH_ND = re.compile(
    r"^Building \d+-D device mesh with (?P<names>\[[^\]]*\]), (?P<dims>\[[^\]]*\])$"
)
# distributed/activation_checkpoint.py:249 (v0.2.2; v0.1.0 llama3/infra/parallelize.py:298):
# f"Applied {ac_config.mode} activation checkpointing to the model"; b5bcd76c :161-163:
# f"Applied {type(self).__name__} activation checkpointing to the model" (FullAC, SelectiveAC);
# memory_budget mode logs f"Selected {memory_budget} budget option" instead (:236 at v0.2.2).
_AC = re.compile(r"^Applied (?P<mode>\w+) activation checkpointing to the model$")
_AC_BUDGET = re.compile(r"^Selected (?P<budget>\S+) budget option$")
# distributed/pipeline_parallel.py:211-214 (v0.2.2), :337-340 (b5bcd76c):
# f"Using pipeline schedule {schedule} with {n_microbatches} microbatches and {stages} stages."
_PIPE = re.compile(
    r"^Using pipeline schedule (?P<schedule>\S+) with (?P<micro>\d+) microbatches and "
    r"(?P<stages>\d+) stages\.$"
)
# distributed/pipeline_parallel.py:480-483 (v0.2.2), :633-636 (b5bcd76c):
# f"PP rank {pp_rank} is building stage_idx {stage_idx} with modules {module_names}"
_STAGE = re.compile(
    r"^PP rank \d+ is building stage_idx (?P<idx>\d+) with modules (?P<mods>\[.*\])$"
)
# components/loss.py:34 (v0.2.2), :251 (b5bcd76c)
_LOSS_COMPILED = re.compile(r"^Compiling the loss function with torch\.compile$")
# models/llama3/infra/parallelize.py:269 (v0.2.2), distributed/compile.py:72 (b5bcd76c)
_MODEL_COMPILED = re.compile(r"^Compiling each TransformerBlock with torch\.compile$")
# distributed/tensor_parallel.py:27 (v0.2.2), distributed/compile.py:96 (b5bcd76c)
_ASYNC_TP = re.compile(r"^Async TP is enabled$")
# components/quantization/float8.py:75-77 and :100 (v0.2.2), :118 (b5bcd76c); v0.1.0's MX
# converter logs the Float8 line with its MX recipe (mx.py:67), later "MX training active"
# (mx.py:68 at v0.2.2).
_FLOAT8 = re.compile(
    r"^(?:Float8 training active with recipe (?P<recipe>\S+)|"
    r"(?P<tensorwise>Float8 tensorwise scaled training active))$"
)
_MX = re.compile(r"^MX training active with recipe (?P<recipe>\S+)$")
# config/job_config.py:1031-1033 (v0.2.2), trainer.py:224-226 (b5bcd76c):
# f"Running with configs: {json.dumps(self.to_dict(), indent=2, ensure_ascii=False)}";
# train.py:76 (v0.1.0): f"Running with args: {job_config.to_dict()}" (a dict repr, one line)
_CONFIG = re.compile(r"^Running with (?:configs|args): (?P<body>\{.*)$")

# torchtitan's pipeline schedule names (job_config.py pipeline_parallel_schedule) -> the planner's
_SCHEDULES = {
    "1F1B": "1f1b",
    "Interleaved1F1B": "interleaved",
    "GPipe": "gpipe",
    "DualPipeV": "dualpipev",
}
_DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")


def _message(rest: str) -> str:
    """A line's message: the [titan] logging prefix removed."""
    return _TITAN.sub("", rest, count=1)


def recognises(text: str) -> bool:
    """Whether ``text`` is a torchtitan log: it has torchtitan's step line, or its
    ``[titan]`` logging prefix on a model-building or trainer line."""
    plain = ANSI.sub("", text)
    if re.search(r"step:\s*\d+\s+loss:\s*\S+\s+(?:grad_norm:\s*\S+\s+)?memory:\s*[\d.]+GiB", plain):
        return True
    return bool(
        re.search(
            r"\[titan\] [^\n]* - (?:Building \S+ \S+|Trainer is initialized with"
            r"|Building device mesh)",
            plain,
        )
    )


def _flatten(value: Any, into: dict[str, Any] | None = None) -> dict[str, Any]:
    """A nested dict's leaves by their own key (the outermost wins a repeated key)."""
    out: dict[str, Any] = {} if into is None else into
    if isinstance(value, dict):
        nested = []
        for key, item in value.items():
            if isinstance(item, dict):
                nested.append(item)
            else:
                out.setdefault(str(key), item)
        for item in nested:
            _flatten(item, out)
    return out


# one name=value pair of a dataclass repr (a nested dataclass's fields come out flat)
_REPR_PAIR = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^,()\s]+)")


_UNREAD = object()  # what ``_literal`` returns for text that is no Python literal


def _literal(text: str) -> Any:
    """``text`` as the Python literal it is (``_UNREAD`` where it is none); the parser's
    warnings about odd input are not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return _UNREAD


def _repr_fields(text: str) -> dict[str, Any]:
    """The fields of a dataclass repr such as ``TransformerModelArgs(dim=4096, ...)``, nested
    dataclasses flattened, each value as Python reads it (else its text)."""
    out: dict[str, Any] = {}
    for key, raw in _REPR_PAIR.findall(text):
        value = _literal(raw)
        out.setdefault(key, raw if value is _UNREAD else value)
    return out


def _path(config: dict[str, Any], *keys: str) -> Any:
    """``config[k1][k2]...`` or None."""
    value: Any = config
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


@dataclass
class _Start:
    """One start of the training loop in one writer's lines."""

    first_step: int | None  # the step it starts at (None: the log does not say)
    lines: list[tuple[int, int, float, float]] = field(default_factory=list)
    # (step, first step the line averages over, tps, reserved GiB)


def _scan(lines: list[Line], found: Settings) -> list[_Start]:
    """Read one writer's lines into ``found`` and return its starts with their step lines."""
    starts: list[_Start] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        text = line.text
        if m := _STEP.match(text):
            step = int(m["step"])
            if not starts or (starts[-1].lines and step < starts[-1].lines[-1][0]):
                starts.append(_Start(None))  # no start line, or the counter went back
            current = starts[-1]
            if not current.lines:
                first = current.first_step or step
            elif step == current.lines[-1][0]:  # the same step from another, unprefixed rank
                first = current.lines[-1][1]
            else:
                first = current.lines[-1][0] + 1
            tps = float(m["tps"].replace(",", ""))
            current.lines.append((step, first, tps, float(m["gib"])))
        elif m := _START.match(text):
            starts.append(_Start(int(m["step"])))
        elif m := _BUILD_ARGS.match(text):
            found.put("model", (m["name"], m["flavor"]), line.no)
            if m["args"] == "{":
                args, i = json_block(lines, i, "{")
                if isinstance(args, dict):
                    found.put("model_args", _flatten(args), line.no)
                else:
                    found.put("model_args_cut", line.no, line.no)
            else:
                found.put("model_args", _repr_fields(m["args"]), line.no)
        elif m := _BUILD_NAME.match(text):
            found.put("model", (m["name"], m["flavor"]), line.no)
        elif m := _PARAMS.match(text):
            found.put("params", int(m["n"].replace(",", "")), line.no)
        elif m := _TRAINER_BATCH.match(text):
            for key in ("local", "global_", "ga", "seq"):
                found.put(f"batch.{key}", int(m[key]), line.no)
        elif m := _TRAINER_TOKENS.match(text):
            for key in ("per_dp", "per_step", "ga", "seq"):
                found.put(f"tokens.{key}", int(m[key]), line.no)
        elif m := _MESH.match(text):
            dims = dict(re.findall(r"(\w+)=(\d+)", m["dims"]))
            for name in _DEGREES:
                if name in dims:
                    found.put(f"mesh.{name}", int(dims[name]), line.no)
        elif m := _MESH_ND.match(text):
            _mesh_nd(m["names"], m["dims"], line.no, found)
        elif m := _AC.match(text):
            found.put("ac", m["mode"], line.no)
        elif m := _AC_BUDGET.match(text):
            found.put("ac", "memory_budget", line.no)
        elif m := _PIPE.match(text):
            found.put("pipe.schedule", m["schedule"], line.no)
            found.put("pipe.micro", int(m["micro"]), line.no)
            found.put("pipe.stages", int(m["stages"]), line.no)
        elif m := _STAGE.match(text):
            modules = _literal(m["mods"])
            if isinstance(modules, list):
                found.put(f"stage.{int(m['idx'])}", tuple(str(x) for x in modules), line.no)
        elif _LOSS_COMPILED.match(text):
            found.put("loss_compiled", True, line.no)
        elif _MODEL_COMPILED.match(text):
            found.put("model_compiled", True, line.no)
        elif _ASYNC_TP.match(text):
            found.put("async_tp", True, line.no)
        elif m := _FLOAT8.match(text):
            recipe = m["recipe"] or "tensorwise"
            found.put("mx" if recipe.startswith("mx") else "float8", recipe, line.no)
        elif m := _MX.match(text):
            found.put("mx", m["recipe"], line.no)
        elif m := _CONFIG.match(text):
            body = m["body"]
            config: Any = None
            if body.strip() == "{":
                config, i = json_block(lines, i, "{")
            else:
                config = _literal(body)
            if isinstance(config, dict):
                found.put("config", config, line.no)
        i += 1
    return starts


def _mesh_nd(names_text: str, dims_text: str, no: int, found: Settings) -> None:
    """The degrees of a ``Building N-D device mesh with [names], [sizes]`` line."""
    names, dims = _literal(names_text), _literal(dims_text)
    if not (isinstance(names, list) and isinstance(dims, list) and len(names) == len(dims)):
        return
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return
    if "dp_shard_mod_ep" in names:
        found.put("mesh.expert_nd", True, no)  # the expert-parallel mesh: ep, etp not stated
        return
    stated = dict(zip(names, dims, strict=True))
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        found.put(f"mesh.{name}", int(stated.get(name, 1)), no)


# --- the model ---------------------------------------------------------------------------------


def _llama3_from_args(args: dict[str, Any], label: str) -> ModelSpec:
    """A llama3 ``TransformerModelArgs`` as a model: torchtitan's FeedForward width
    (4 * dim, two thirds of it, times ffn_dim_multiplier, rounded up to multiple_of;
    models/llama3/model/model.py), GQA with n_kv_heads (n_heads when None), untied output,
    no biases; RoPE scaling where the args carry ``rope_scaling_args`` (v0.2 on)."""
    dim, heads = int(args["dim"]), int(args["n_heads"])
    kv = int(args.get("n_kv_heads") or heads)
    width = int(2 * 4 * dim / 3)
    if args.get("ffn_dim_multiplier") is not None:
        width = int(float(args["ffn_dim_multiplier"]) * width)
    multiple = int(args["multiple_of"])
    scaling: tuple[tuple[str, str | float], ...] = ()
    if "scaling_factor" in args:
        scaling = tuple(
            sorted(
                (
                    ("factor", float(args["scaling_factor"])),
                    ("high_freq_factor", float(args["high_freq_factor"])),
                    ("low_freq_factor", float(args["low_freq_factor"])),
                    (
                        "original_max_position_embeddings",
                        float(args["original_max_position_embeddings"]),
                    ),
                    ("rope_type", "llama3"),
                )
            )
        )
        if scaling == tuple(sorted(LLAMA3_SCALING)):
            scaling = LLAMA3_SCALING
    return ModelSpec(
        name=label,
        hidden_size=dim,
        num_layers=int(args["n_layers"]),
        vocab_size=int(args["vocab_size"]),
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=dim // heads,
        attention="gqa" if kv < heads else "mha",
        mlp="swiglu",
        ffn_hidden_size=multiple * math.ceil(width / multiple),
        tie_word_embeddings=False,
        norm_eps=float(args.get("norm_eps", 1e-5)),
        rope_theta=float(args["rope_theta"]),
        rope_scaling=scaling,
    )


# deepseek_v3 args that planner.export.flavors fixes for every flavor (DeepSeekV3ModelArgs
# defaults at v0.2.2: models/deepseek_v3/model/args.py)
_DEEPSEEK_FIXED = {
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


# the deepseek_v3 args a log must carry for the flavor check (DeepSeekV3ModelArgs, MoEArgs)
_DEEPSEEK_CORE = (
    "dim",
    "n_layers",
    "n_heads",
    "vocab_size",
    "inter_dim",
    "moe_inter_dim",
    "n_dense_layers",
    "num_experts",
    "top_k",
)


def _model(found: Settings, where: str, seq_len: int, notes: list[str]) -> ModelSpec:
    """The model the log builds (see the module docstring); refused in one line where the
    log does not state one the planner can build exactly."""
    stated = found.get("model")
    if stated is None:
        raise PlannerError(
            f"{where}: torchtitan log states no model (no 'Building ... with ...' line)"
        )
    name, flavor = stated
    label = f"{name} {flavor}"
    if "model_args_cut" in found and "model_args" not in found:
        raise PlannerError(
            f"{where}: line {found.get('model_args_cut')}: the model args of {label} are cut off "
            "or not JSON; cannot build the model"
        )
    args: dict[str, Any] | None = found.get("model_args")
    known = flavors(seq_len)
    if name == "llama3" and args is not None:
        try:
            model = _llama3_from_args(args, label)
        except (KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError) as exc:
            raise PlannerError(
                f"{where}: torchtitan model {label}: its logged args lack or garble {exc}; "
                "cannot build it"
            ) from None
    elif (name, flavor) in known and name == "deepseek_v3" and args is not None:
        expected = {**DEEPSEEK_V3[flavor], **_DEEPSEEK_FIXED}
        expected.pop("mscale")  # a softmax scale, no cost reads it
        lacking = [k for k in _DEEPSEEK_CORE if k not in args]
        if lacking:
            raise PlannerError(
                f"{where}: torchtitan model {label}: its logged args lack {', '.join(lacking)}; "
                "cannot check them against the flavor"
            )
        differ = [
            f"{k}={args[k]!r} (flavor {v!r})"
            for k, v in expected.items()
            if k in args and args[k] != v and not (k == "q_lora_rank" and not args[k] and not v)
        ]
        if differ:
            raise PlannerError(
                f"{where}: torchtitan model {label}: its logged args differ from the {flavor} "
                f"flavor the planner knows: {', '.join(differ)}"
            )
        model = known[name, flavor].model_copy(update={"name": label})
        if "load_balance_coeff" in args and args["load_balance_coeff"] is None:
            model = model.model_copy(update={"router_expert_bias": False})
    elif (name, flavor) in known:
        model = known[name, flavor].model_copy(update={"name": label})
        notes.append(
            f"model: the log names {label} without its args; taken as that flavor at "
            "torchtitan v0.2.2 (planner.export.flavors)"
        )
    else:
        raise PlannerError(
            f"{where}: torchtitan model {label}: the planner builds llama3 from its logged args "
            "and knows the llama3 and deepseek_v3 flavors "
            f"({', '.join(' '.join(k) for k in known)}); this log states neither"
        )
    params = found.get("params")
    if params is not None and params != model.num_params():
        raise PlannerError(
            f"{where}: torchtitan model {label}: the log states {params:,} parameters but the "
            f"model built from it has {model.num_params():,}; cannot state it exactly"
        )
    return model


# --- the run -----------------------------------------------------------------------------------


def _norm_type(found: Settings) -> Any:
    """The norm torchtitan's older model code built (None where the log names none): the
    job config's model.norm_type, or the model args' norm_type."""
    named = _config_value(found, "model", "norm_type")
    args = found.get("model_args")
    return named if named is not None else (args or {}).get("norm_type")


def _config_value(found: Settings, *keys: str) -> Any:
    """The job config dump's value at ``keys`` (None without a dump or that key)."""
    config = found.get("config")
    return _path(config, *keys) if isinstance(config, dict) else None


def _int_setting(where: str, what: str, value: Any) -> int:
    """``value`` as a positive whole number (a one-line error naming ``what`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlannerError(f"{where}: {what}={value!r}: must be a positive whole number")
    return value


_CONFIG_DEGREES = {
    "pp": "pipeline_parallel_degree",
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "ep": "expert_parallel_degree",
    "etp": "expert_tensor_parallel_degree",
}


def _degrees(found: Settings, where: str, notes: list[str]) -> dict[str, int]:
    """pp, dp_replicate, dp_shard, cp, tp, ep, etp as the log states them: the device-mesh
    line, else the job config dump (whose dp_shard -1 is resolved only by the mesh line)."""
    if "mesh.expert_nd" in found and "mesh.tp" not in found:
        raise PlannerError(
            f"{where}: the 'Building N-D device mesh' line of an expert-parallel run does not "
            "state ep and etp (torchtitan v0.2.0); the log needs its job config dump"
        )
    mesh = "mesh.tp" in found
    out: dict[str, int] = {}
    for name, config_key in _CONFIG_DEGREES.items():
        value = found.get(f"mesh.{name}")
        if value is None:
            value = _config_value(found, "parallelism", config_key)
        if value is None and name in ("ep", "etp") and mesh:
            value = 1  # a mesh line without it: v0.1.0-v0.2.0 (no experts split) or no etp
            if name == "etp" and out.get("ep", 1) > 1:
                notes.append("etp: the mesh line does not state it; taken as 1")
        if value is None or (name == "dp_shard" and value == -1):
            raise PlannerError(
                f"{where}: torchtitan log states no {name} degree (no 'Building device mesh "
                "with parallelism' line)"
            )
        out[name] = _int_setting(where, name, value)
    return out


def _batch(found: Settings, where: str, dp: int) -> tuple[int, int, int, int]:
    """(seq_len, global batch, sequences per data-parallel rank per forward of a step's
    gradient-accumulation microstep, tokens per train step) as the log states them."""
    if "batch.seq" in found:
        seq = _int_setting(where, "sequence length", found.get("batch.seq"))
        local = _int_setting(where, "local batch size", found.get("batch.local"))
        global_batch = _int_setting(where, "global batch size", found.get("batch.global_"))
        return seq, global_batch, local, global_batch * seq
    if "tokens.seq" in found:
        seq = _int_setting(where, "maximum context length", found.get("tokens.seq"))
        per_dp = _int_setting(where, "tokens per DP rank", found.get("tokens.per_dp"))
        per_step = _int_setting(where, "tokens per train step", found.get("tokens.per_step"))
        if per_step % seq or per_dp % seq:
            raise PlannerError(
                f"{where}: tokens per train step {per_step} and per DP rank {per_dp} are not "
                f"whole sequences of the maximum context length {seq}"
            )
        return seq, per_step // seq, per_dp // seq, per_step
    training = _config_value(found, "training")
    if isinstance(training, dict) and "seq_len" in training and "local_batch_size" in training:
        seq = _int_setting(where, "training.seq_len", training["seq_len"])
        local = _int_setting(where, "training.local_batch_size", training["local_batch_size"])
        global_batch = training.get("global_batch_size", -1)
        global_batch = local * dp if global_batch in (-1, None) else global_batch
        global_batch = _int_setting(where, "training.global_batch_size", global_batch)
        return seq, global_batch, local, global_batch * seq
    raise PlannerError(
        f"{where}: torchtitan log states no batch size or sequence length (no 'Trainer is "
        "initialized with' line)"
    )


def _recompute(found: Settings, where: str, notes: list[str]) -> tuple[str, int]:
    """torchtitan's activation checkpointing as a recompute choice: ("none" | "full" | "op" |
    "layer", the layer-SAC frequency where "layer")."""
    mode = found.get("ac")
    if mode is None:
        return "none", 0
    if mode in ("full", "FullAC"):
        return "full", 0
    if mode == "SelectiveAC":
        return "op", 0
    if mode == "memory_budget":
        raise PlannerError(
            f"{where}: activation checkpointing mode memory_budget: the compiler's partitioner "
            "chooses what to keep; the planner prices none, full, op or per-layer choices"
        )
    if mode != "selective":
        raise PlannerError(f"{where}: activation checkpointing mode {mode!r} is not torchtitan's")
    option = _config_value(found, "activation_checkpoint", "selective_ac_option")
    if option is None:
        option = "2"
        notes.append(
            "activation_checkpoint.selective_ac_option: not stated; torchtitan's default '2' "
            "(every second layer checkpointed whole)"
        )
    option = str(option)
    if option == "op":
        return "op", 0
    if option.isdigit():
        return "layer", int(option)
    raise PlannerError(
        f"{where}: selective_ac_option={option!r}: must be 'op' or a layer frequency"
    )


def _layer_sac(layout: Layout, every: int) -> dict[str, str]:
    """torchtitan's layer SAC: each process counts the transformer blocks it wraps, in the
    order of its model chunks, and checkpoints the k-th whole where k % every == 0
    (``_apply_layer_sac``, distributed/activation_checkpoint.py:27-47 at v0.2.2; every 0:
    all). Returns block name -> "full" for those blocks."""
    chosen: dict[str, str] = {}
    for rank in range(layout.pp):
        count = 0
        for chunk in layout.chunks_of_rank(rank):
            for placement in layout.stages[chunk].blocks:
                if placement.block.startswith("layer."):
                    count += 1
                    if every == 0 or count % every == 0:
                        chosen[placement.block] = "full"
    return chosen


def read(text: str, path: str) -> LoggedRun:
    """The run a torchtitan log states: its model, job and layout, and the median seconds per
    step over the step lines after each start's warm-up (the first step line of each start and
    every line averaging over one of its first three steps; each line's time is the average
    over the steps since the line before). Every refusal is one line naming ``path``.
    Assumes one run per file; restarts resume it."""
    return naming_the_log(path, lambda where: _read(text, path, where))


def _read(text: str, path: str, where: str) -> LoggedRun:
    """The body of ``read``; refusals name the file through ``where``."""
    by_writer, notes = streams(text, _RANK, _message)
    found = Settings(where)
    scanned = {key: _scan(lines, found) for key, lines in by_writer.items()}
    if found.get("model") is None:
        raise PlannerError(
            f"{where}: torchtitan log states no model (no 'Building ... with ...' line)"
        )

    degrees = _degrees(found, where, notes)
    pp, rep, shard, cp, tp = (degrees[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    if rep > 1 and shard * cp > 1:
        raise PlannerError(
            f"{where}: dp_replicate={rep} with dp_shard*cp={shard * cp}: HSDP shards the "
            "weights within a replica only; the planner shards ZeRO state over all data ranks"
        )
    dp = rep * shard
    world = pp * dp * cp * tp
    seq, global_batch, local, tokens_per_step = _batch(found, where, dp)
    model = _model(found, where, seq, notes)

    if found.get("mx") is not None:
        raise PlannerError(
            f"{where}: MX training (recipe {found.get('mx')}): the planner prices BF16 and "
            "tensor- or row-wise FP8 GEMMs, not MX block scaling"
        )
    precision = _config_value(found, "training", "mixed_precision_param")
    if precision == "float32":
        raise PlannerError(
            f"{where}: training.mixed_precision_param='float32': an FP32 run; the planner "
            "prices BF16 or FP8 compute"
        )
    if precision is None:
        notes.append("training.mixed_precision_param: not stated; torchtitan's default bfloat16")
    job = TrainingJob(
        seq_len=seq,
        global_batch=global_batch,
        framework="torchtitan",
        compute_dtype="fp8" if found.get("float8") else "bf16",
        compiled_loss=bool(found.get("loss_compiled")),
        compiled_model=bool(found.get("model_compiled")),
        # torchtitan before April 2025 named its norm (job config model.norm_type, copied
        # into ModelArgs.norm_type); "rmsnorm" was its own eager RMSNorm class
        # (torchtitan/models/norms.py at 9dec370), "fused_rmsnorm" a Triton kernel
        # (priced only where nothing compiles the model: costs.memory.shard_of)
        eager_norm=_norm_type(found) == "rmsnorm",
        tp_comm_overlap=bool(found.get("async_tp")),
    )

    # ZeRO: FSDP2 over dp_shard * cp (parallel_dims.py fsdp mesh); reshard_after_forward policy
    # "default" reshards unless pipeline parallel (llama3/infra/parallelize.py:319-327, v0.2.2)
    zero = 0
    if shard * cp > 1:
        policy = _config_value(found, "parallelism", "fsdp_reshard_after_forward")
        if policy is None:
            policy = "default"
            notes.append(
                "parallelism.fsdp_reshard_after_forward: not stated; torchtitan's default "
                "('default': reshard after forward unless pipeline parallel)"
            )
        reshard = policy == "always" or (policy == "default" and pp == 1)
        zero = 3 if reshard else 2

    schedule, virtual, micro = "1f1b", 1, local
    if pp > 1:
        name = found.get("pipe.schedule")
        n_micro = found.get("pipe.micro")
        if name is None:
            name = _config_value(found, "parallelism", "pipeline_parallel_schedule") or "1F1B"
            notes.append(
                f"pipeline schedule: no 'Using pipeline schedule' line; taken as {name} "
                "(the job config's, else torchtitan's default 1F1B)"
            )
        if name not in _SCHEDULES:
            raise PlannerError(
                f"{where}: pipeline schedule {name!r}: the planner runs "
                f"{', '.join(_SCHEDULES)} of torchtitan's"
            )
        schedule = _SCHEDULES[name]
        stages = found.get("pipe.stages")
        virtual = stages // pp if stages else schedule_of(schedule).default_virtual_stages
        if n_micro is None:
            size = _config_value(found, "parallelism", "pipeline_parallel_microbatch_size")
            if size is None:
                size = 1
                notes.append(
                    "parallelism.pipeline_parallel_microbatch_size: not stated; torchtitan's "
                    "default 1"
                )
            micro = int(size)
        elif n_micro <= 0 or local % n_micro:
            raise PlannerError(
                f"{where}: {n_micro} pipeline microbatches do not divide the local batch {local}"
            )
        else:
            micro = local // n_micro

    ep, etp = degrees["ep"], degrees["etp"]
    fields: dict[str, Any] = {
        "tp": tp,
        "cp": cp,
        "dp": dp,
        "ep": ep,
        "etp": etp if ep > 1 else 1,
        "zero": zero,
        "micro_batch": micro,
    }
    choice, every = _recompute(found, where, notes)
    counts = _stage_counts(found, pp * virtual, model.num_layers)
    if pp > 1 and counts is None:
        notes.append(
            "pipeline stages: the log does not list every stage's modules; layers split evenly"
        )

    def layout_with(recompute: str | dict[str, str]) -> Layout:
        if counts is not None:
            return Layout.from_counts(
                model,
                counts=counts,
                pp=pp,
                recompute=recompute,
                virtual_stages=virtual,
                schedule=schedule,
                **fields,
            )
        return Layout.uniform(
            model, pp=pp, recompute=recompute, virtual_stages=virtual, schedule=schedule, **fields
        )

    try:
        layout = layout_with("none" if choice == "layer" else choice)
        if choice == "layer":
            layout = layout_with(_layer_sac(layout, every))
    except PlannerError as exc:
        raise PlannerError(f"{where}: {exc}") from None

    step_s, iterations, reserved = _steady(scanned, tokens_per_step, world, where, notes)
    return LoggedRun(
        path=path,
        framework="torchtitan",
        model=model,
        job=job,
        layout=layout,
        step_s=step_s,
        iterations=iterations,
        allocated_peak_bytes=None,
        reserved_peak_bytes=reserved,
        notes=tuple(notes),
    )


def _stage_counts(found: Settings, chunks: int, layers: int) -> list[int] | None:
    """Transformer layers per stage from the ``PP rank ... is building stage_idx`` lines,
    where every stage's line is in the log and they hold every layer once."""
    counts = []
    for index in range(chunks):
        modules = found.get(f"stage.{index}")
        if modules is None:
            return None
        counts.append(sum(1 for m in modules if re.fullmatch(r"layers\.\d+", m)))
    return counts if sum(counts) == layers and chunks > 1 else None


def _steady(
    scanned: dict[str, list[_Start]],
    tokens_per_step: int,
    world: int,
    where: str,
    notes: list[str],
) -> tuple[float, int, int | None]:
    """(median seconds per step, how many step lines it is over, the reserved peak in bytes
    over them) after dropping each start's warm-up; per step, the slowest writer's time."""
    kept: dict[tuple[int, int], float] = {}
    peak_gib: float | None = None
    dropped: list[str] = []
    for key, starts in scanned.items():
        for ordinal, start in enumerate(s for s in starts if s.lines):
            origin = start.first_step if start.first_step is not None else start.lines[0][0]
            warm = [
                ln
                for ln in start.lines
                if ln[0] == start.lines[0][0] or ln[1] < origin + WARMUP_STEPS
            ]
            who = f" ({key})" if key else ""
            firsts = [ln for ln in start.lines if ln[0] == start.lines[0][0]]
            if len(warm) == len(start.lines) > len(firsts):
                warm = firsts  # a short start: only its first step's line is dropped
                notes.append(
                    f"start {ordinal + 1}{who}: every step line averages over one of its first "
                    f"{WARMUP_STEPS} steps; kept all but the first"
                )
            dropped.append(
                f"start {ordinal + 1}{who}: step line(s) {', '.join(str(ln[0]) for ln in warm)}"
            )
            for step, _, tps, gib in start.lines[len(warm) :]:
                if not (math.isfinite(tps) and tps > 0):
                    continue
                seconds = tokens_per_step / (tps * world)
                slot = (ordinal, step)
                kept[slot] = max(kept.get(slot, 0.0), seconds)
                peak_gib = gib if peak_gib is None else max(peak_gib, gib)
    if not kept:
        raise PlannerError(
            f"{where}: torchtitan log has no steady-state step lines (each start's first step "
            f"line and the lines over its first {WARMUP_STEPS} steps are warm-up)"
        )
    notes.append("warm-up dropped: " + "; ".join(dropped))
    notes.append(
        "step time: global tokens per step / (tps * world size), each line's average over the "
        "steps since the line before"
    )
    reserved = None if peak_gib is None else round(peak_gib * GIB)
    return statistics.median(kept.values()), len(kept), reserved
