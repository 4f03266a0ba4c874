"""Gemma 2 and 3, GLM-4.5, Llama 4, Phi-3/Phi-4 and Nemotron: read as transformers reads
their configs, costed as they run (windows, chunks, layers without RoPE, soft caps, norms
after each branch, squared ReLU), refused where a field is not costed.

The configs below restate the architecture fields of the released checkpoints (the catalog
holds the vendored files, ``models/index.yaml``); the expected counts come from the papers:
- [G2] Gemma 2 report (arXiv 2408.00118), Table 2: 9B has 8,324,201,984 non-embedding
  parameters.
- [N4] Nemotron-4 340B report (arXiv 2406.11704), section 2.2: "9.4 billion embedding
  parameters and 331.6 billion non-embedding parameters".
- [P3] Phi-3 report (arXiv 2404.14219), section 2: phi-3-mini, "a 3.8B parameters language
  model".
- [L4] Llama 4 model cards (meta-llama/Llama-4-Scout-17B-16E, -Maverick-17B-128E): 17B
  activated parameters each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planner
from planner.costs.blocks import CAUSAL, Shard, attended_share, block_cost
from planner.export.megatron_model import model_args
from planner.logs import read_log
from planner.solve.tables import layer_kind

GEMMA2_9B = {
    "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "vocab_size": 256000, "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 256, "rope_theta": 10000.0,
}  # fmt: skip
NEMOTRON4_340B = {
    "model_type": "nemotron", "hidden_size": 18432, "intermediate_size": 73728,
    "num_hidden_layers": 96, "num_attention_heads": 96, "num_key_value_heads": 8,
    "vocab_size": 256000, "hidden_act": "relu2", "norm_eps": 1e-5,
    "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
}  # fmt: skip
PHI3_MINI = {
    "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32064, "hidden_act": "silu", "sliding_window": 2047, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
}  # fmt: skip
LLAMA4_TEXT = {
    "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048,
    "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    "attention_chunk_size": 8192, "use_qk_norm": True, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}  # fmt: skip
SCOUT = {"model_type": "llama4", "text_config": LLAMA4_TEXT, "vision_config": {}}
MAVERICK = {
    "model_type": "llama4",
    "text_config": {**LLAMA4_TEXT, "num_local_experts": 128, "interleave_moe_layer_step": 2},
}


LOGS = Path(__file__).parent / "data" / "logs"


def load(cfg: dict[str, object]) -> planner.ModelSpec:
    return planner.load_model(cfg)


def plan_of(
    model: planner.ModelSpec,
    cluster: planner.ClusterSpec,
    job: planner.TrainingJob,
    layout: planner.Layout,
) -> planner.Plan:
    """A plan of ``layout`` as it evaluates, for the exports."""
    est = planner.evaluate(model, cluster, job, layout)
    return planner.Plan(
        status="feasible", layout=layout, estimate=est, solve_time_s=0.0,
        model=model, cluster=cluster, job=job,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# the catalog's files against the published totals
# [HF] Hugging Face safetensors-metadata totals as third parties quote them (models/index.yaml)

EXACT = [
    ("gemma2-9b", 9_241_705_984, "[HF] google/gemma-2-9b"),
    ("gemma2-27b", 27_227_128_320, "[HF] google/gemma-2-27b"),
    ("gemma3-1b", 999_885_952, "[HF] google/gemma-3-1b-it"),
    ("phi3-mini-4k", 3_821_079_552, "[HF] microsoft/Phi-3-mini-4k-instruct"),
    ("phi-4", 14_659_507_200, "[HF] microsoft/phi-4"),
]


@pytest.mark.parametrize(("name", "total", "source"), EXACT, ids=[e[0] for e in EXACT])
def test_catalog_totals_match_the_checkpoints(name: str, total: int, source: str) -> None:
    assert planner.load_model(name).num_params() == total, source


@pytest.mark.parametrize(
    ("name", "non_embedding"), [("gemma2-9b", 8_324_201_984), ("gemma2-27b", 26_047_480_320)]
)
def test_gemma2_non_embedding_parameters_match_the_report(name: str, non_embedding: int) -> None:
    """[G2] Table 2 counts the embedding at 256,128 rows where the checkpoint has 256,000, so
    only its non-embedding figure compares exactly."""
    gemma = planner.load_model(name)
    assert gemma.num_params() - gemma.vocab_size * gemma.hidden_size == non_embedding


def test_gemma3_1b_matches_the_report_table() -> None:
    """Gemma 3 report (arXiv 2503.19786) Table 1, 1B: 302M embedding, 698M non-embedding."""
    gemma = planner.load_model("gemma3-1b")
    embedding = gemma.vocab_size * gemma.hidden_size
    assert (round(embedding / 1e6), round((gemma.num_params() - embedding) / 1e6)) == (302, 698)


def test_glm45_totals_less_what_the_checkpoint_stores_twice() -> None:
    """[HF] zai-org/GLM-4.5 stores 358,337,791,296 elements and GLM-4.5-Air 110,468,824,832.
    Beyond the parameters the planner counts, the checkpoint holds the MTP layer's own copies
    of the embedding and the output head (2 x vocabulary x hidden; trained tied to the main
    model's, as DeepSeek-V3's MTP) and each MoE layer's routing-bias buffer (one float per
    expert; 89 + 1 MTP layers of 160 experts, 45 + 1 of 128)."""
    for name, stored, moe_layers in (
        ("glm4.5", 358_337_791_296, 90),
        ("glm4.5-air", 110_468_824_832, 46),
    ):
        glm = planner.load_model(name)
        copies = 2 * glm.vocab_size * glm.hidden_size
        assert glm.num_params() + copies + moe_layers * glm.num_experts == stored, name


def test_multimodal_totals_less_their_vision_towers() -> None:
    """The planner counts the language model of a multimodal config; the checkpoint's rest is
    the vision tower, counted here by hand from its vision_config and transformers' modules.

    Llama 4 (Llama4VisionModel, 34 layers of width 1408, MLP 5632, 336-pixel images in
    14-pixel patches): patch projection 3*14*14*1408, class embedding 1408, positions
    (24^2 + 1) * 1408, two LayerNorms with biases 2*2*1408; per layer q, k, v, o with biases
    4*(1408^2 + 1408), fc1 and fc2 with biases 2*1408*5632 + 5632 + 1408, two LayerNorms
    4*1408; the pixel-shuffle MLP (ratio 0.5: 4*1408 = 5632 in) 5632*4096 + 4096*4096 without
    biases; the projector 4096 -> 5120 without bias. [HF] Llama-4-Scout-17B-16E-Instruct
    stores 108,641,793,536.

    Gemma 3 27B (SigLIP: 27 layers of width 1152, MLP 4304, 896-pixel images in 14-pixel
    patches): patch convolution 3*14*14*1152 + 1152, positions 64^2 * 1152, per layer
    4*(1152^2 + 1152) + 2*1152*4304 + 4304 + 1152 + 4*1152, a final LayerNorm 2*1152; the
    projector's 1152 x 5376 matrix and its RMSNorm of 1152. [HF] gemma-3-27b-it stores
    27,432,406,640."""
    w, m = 1408, 5632
    llama4_vision = (
        3 * 14 * 14 * w + w + (24**2 + 1) * w + 2 * 2 * w
        + 34 * (4 * (w * w + w) + 2 * w * m + m + w + 4 * w)
        + 4 * w * 4096 + 4096 * 4096 + 4096 * 5120
    )  # fmt: skip
    assert planner.load_model("llama4-scout").num_params() + llama4_vision == 108_641_793_536
    w, m = 1152, 4304
    siglip = (
        3 * 14 * 14 * w + w + 64**2 * w
        + 27 * (4 * (w * w + w) + 2 * w * m + m + w + 4 * w) + 2 * w
        + w * 5376 + w
    )  # fmt: skip
    assert planner.load_model("gemma3-27b").num_params() + siglip == 27_432_406_640


def test_gemma3_27b_non_embedding_matches_the_report() -> None:
    """Gemma 3 report Table 1, 27B: 25,600M non-embedding parameters. (Its 1,416M embedding
    matches neither 262,208 nor 262,144 rows of 5,376; not compared.)"""
    gemma = planner.load_model("gemma3-27b")
    assert round((gemma.num_params() - gemma.vocab_size * gemma.hidden_size) / 1e6) == 25_600


# ---------------------------------------------------------------------------------------
# parameters against the papers


def test_gemma2_9b_non_embedding_parameters() -> None:
    gemma = load(GEMMA2_9B)
    assert gemma.num_params() - gemma.vocab_size * gemma.hidden_size == 8_324_201_984  # [G2]


def test_nemotron4_340b_parameters() -> None:
    """[N4], to the 0.1B it states; untied, so the head is embedding parameters too."""
    nemotron = load(NEMOTRON4_340B)
    embedding = 2 * nemotron.vocab_size * nemotron.hidden_size
    assert round(embedding / 1e8) == 94
    assert round((nemotron.num_params() - embedding) / 1e8) == 3316


def test_phi3_mini_parameters() -> None:
    assert round(load(PHI3_MINI).num_params() / 1e8) == 38  # [P3]


@pytest.mark.parametrize("cfg", [SCOUT, MAVERICK], ids=["scout", "maverick"])
def test_llama4_active_parameters(cfg: dict[str, object]) -> None:
    """[L4]: 17B activated (one routed expert and the shared one; the embedding and head
    counted whole)."""
    assert round(load(cfg).num_params(active=True) / 1e9) == 17


# ---------------------------------------------------------------------------------------
# which layers are what


def test_llama4_layers_as_transformers_builds_them() -> None:
    """Llama4TextConfig: moe_layers = range(step - 1, n, step); no_rope_layers marks every
    fourth layer 0 (no RoPE, global attention), the others chunked."""
    maverick = load(MAVERICK)
    assert [maverick.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert maverick.nope_layers == tuple(range(3, 48, 4))
    assert [maverick.attention_chunk(i) for i in range(4)] == [8192, 8192, 8192, None]
    assert [layer_kind(maverick, i) for i in range(4)] == [
        "dense-chunk8192",
        "moe-chunk8192",
        "dense-chunk8192",
        "moe-nope",
    ]
    scout = load(SCOUT)
    assert all(scout.is_moe_layer(i) for i in range(48))
    # a dense layer is an MLP of intermediate_size_mlp; an MoE layer's experts and shared
    # expert are of intermediate_size
    shard = Shard(seq_len=1)
    dense, moe = (
        {p.key.split(".", 2)[-1]: p.numel for p in block_cost(maverick, f"layer.{i}", shard).params}
        for i in (0, 1)
    )
    assert dense["mlp"] == 3 * 5120 * 16384
    assert moe["experts"] == 128 * 3 * 5120 * 8192
    assert moe["shared_experts"] == 3 * 5120 * 8192
    assert "q_norm" not in moe  # the L2 norm has no weights


def chunk_pairs(seq: int, chunk: int) -> float:
    """Pairs (query, key) with the key in the query's chunk at or before it, less half the
    diagonal (the causal convention of ``attended_share``)."""
    return sum(p % chunk + 1 for p in range(seq)) - seq / 2


@pytest.mark.parametrize(("seq", "chunk"), [(512, 128), (300, 64), (256, 256), (128, 512)])
def test_attended_share_counts_chunks(seq: int, chunk: int) -> None:
    assert attended_share(seq, None, chunk) * seq**2 == pytest.approx(chunk_pairs(seq, chunk))


def test_llama4_chunked_layer_attends_a_quarter_at_four_chunks() -> None:
    """At 32,768 tokens a chunked layer computes 4 causal 8,192-token blocks: a quarter of the
    global layer's score FLOPs (2 * heads * d per pair for QK^T and PV each)."""
    maverick = load(MAVERICK)
    s = 32768
    chunked, full = (block_cost(maverick, f"layer.{i}", Shard(seq_len=s)) for i in (2, 3))
    assert chunked.fwd.attention == pytest.approx(4 * 40 * 128 * 4 * 8192**2 * CAUSAL)
    assert full.fwd.attention == pytest.approx(4 * 40 * 128 * s * s * CAUSAL)


def test_a_layer_without_rope_skips_the_rotary_and_qk_norm_passes() -> None:
    """Layers 2 (chunked, RoPE, L2 norm) and 3 (global, neither) of Maverick at a sequence no
    longer than a chunk: the same attention FLOPs; layer 2 moves 2 x 2 bytes x (q + k
    widths) per token more, a read and a write for the rotary turn and again for the norm
    (layer 3 is MoE and 2 dense, so compare their attention halves through a dense copy)."""
    maverick = load(MAVERICK)
    dense_only = maverick.model_copy(update={"moe_layers": ()})
    s = 4096
    rope, nope = (block_cost(dense_only, f"layer.{i}", Shard(seq_len=s)) for i in (2, 3))
    assert rope.fwd.attention == nope.fwd.attention
    widths = (40 + 8) * 128
    assert rope.fwd.memory - nope.fwd.memory == pytest.approx(2 * 2 * (2 * s * widths))


# ---------------------------------------------------------------------------------------
# Gemma: windows, norms after each branch, the logits' soft cap


def test_gemma2_alternates_windows_from_the_first_layer() -> None:
    gemma = load(GEMMA2_9B)
    assert [gemma.attention_window(i) for i in range(4)] == [4096, None, 4096, None]


def test_gemma3_five_local_layers_to_one_global() -> None:
    """Gemma3TextConfig: layer i slides unless (i + 1) % 6 == 0; defaults fill the keys the
    nested text config leaves out (here num_attention_heads 8, num_key_value_heads 4)."""
    gemma3 = load(
        {
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "num_hidden_layers": 34,
                "sliding_window": 1024,
            },
            "vision_config": {"hidden_size": 1152},
        }
    )
    assert gemma3.num_attention_heads == 8 and gemma3.num_kv_heads == 4
    assert gemma3.head_dim == 256 and gemma3.vocab_size == 262208
    assert [gemma3.attention_window(i) is None for i in range(12)] == [
        i in (5, 11) for i in range(12)
    ]
    assert gemma3.qk_norm and gemma3.post_norms and gemma3.final_logit_softcap is None


def test_gemma_post_norms_and_softcap_cost_what_they_keep() -> None:
    """Each post-norm keeps its input (the branch's output, BF16) and has h weights; the soft
    cap keeps the tanh's output, one BF16 logit per token and vocabulary entry."""
    gemma = load(GEMMA2_9B)
    plain = gemma.model_copy(update={"post_norms": False, "final_logit_softcap": None})
    s, h, v = 4096, 3584, 256000
    shard = Shard(seq_len=s)
    layer, bare = block_cost(gemma, "layer.1", shard), block_cost(plain, "layer.1", shard)
    assert sum(p.numel for p in layer.params) - sum(p.numel for p in bare.params) == 2 * h
    assert layer.saved_bytes() - bare.saved_bytes() == 2 * s * h * 2
    head, bare_head = block_cost(gemma, "head", shard), block_cost(plain, "head", shard)
    assert head.saved_bytes() - bare_head.saved_bytes() == s * v * 2


def test_squared_relu_mlp_has_no_gate() -> None:
    """Nemotron's MLP is up and down projections only: 2 h f weights, 2 x 2 h f FLOPs a
    token forward."""
    nemotron = load(NEMOTRON4_340B)
    h, f, s = 18432, 73728, 1024
    layer = block_cost(nemotron, "layer.0", Shard(seq_len=s))
    params = {p.key.split(".", 2)[-1]: p.numel for p in layer.params}
    assert params["mlp"] == 2 * h * f
    attention = 2 * s * (2 * h * h + 2 * h * 8 * 192)  # q, o and the 8 kv heads' k, v
    assert layer.fwd.gemm == pytest.approx(2 * 2 * s * h * f + attention)


# ---------------------------------------------------------------------------------------
# refusals and exports


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {**GEMMA2_9B, "hidden_activation": "relu"},
            'model config custom: hidden_activation="relu" is not supported (one of '
            "gelu_pytorch_tanh, gelu_tanh)",
        ),
        (
            {**NEMOTRON4_340B, "hidden_act": "gelu"},
            'model config custom: hidden_act="gelu" is not supported (one of relu2)',
        ),
        (
            {**PHI3_MINI, "embd_pdrop": 0.1},
            "model config custom: embd_pdrop=0.1 is not supported (must be 0 or resid_pdrop=0.0)",
        ),
        (
            {**LLAMA4_TEXT, "no_rope_layers": [1, 0]},
            "model config custom: no_rope_layers=[1, 0] is not supported (48 entries of 0 or "
            "1, one per layer)",
        ),
        (
            {**LLAMA4_TEXT, "sliding_window": 4096},
            "model config custom: sliding_window=4096 is not supported (attention to a window "
            "of keys; the llama4_text reader does not cost it)",
        ),
        (
            {"model_type": "gemma3", "vision_config": {}},
            "model config custom: model_type='gemma3' needs a text_config object (the "
            "language model's config)",
        ),
    ],
    ids=["gemma-act", "nemotron-act", "phi3-dropout", "llama4-rope", "llama4-window", "gemma3"],
)
def test_refused_with_the_field_and_rule(cfg: dict[str, object], message: str) -> None:
    with pytest.raises(planner.PlannerError) as info:
        load(cfg)
    assert str(info.value) == message


def test_megatron_export_states_the_new_features() -> None:
    """Megatron-LM arguments (arguments.py): --squared-relu, --apply-layernorm-1p,
    --rotary-percent, --no-rope-freq (a 1 marks a layer without RoPE), --qk-l2-norm; what
    no argument states is a difference."""
    args, diffs = model_args(load(NEMOTRON4_340B), tp=8, seq_len=4096)
    assert "--squared-relu" in args and "--apply-layernorm-1p" in args
    assert args[args.index("--rotary-percent") + 1] == "0.5"
    assert not diffs
    args, diffs = model_args(load(MAVERICK), tp=1, seq_len=8192)
    assert args[args.index("--no-rope-freq") + 1] == "(" + "+".join(["[0]*3+[1]*1"] * 12) + ")"
    assert "--qk-l2-norm" in args
    assert any("chunked attention (8192 tokens)" in d for d in diffs)
    _, diffs = model_args(load(GEMMA2_9B), tp=1, seq_len=8192)
    assert any("norms after the attention and the MLP" in d for d in diffs)
    assert any("soft cap 30.0 on the logits" in d for d in diffs)
    assert any("GeGLU" in d for d in diffs)


def test_a_llama4_layout_evaluates_and_simulates_alike() -> None:
    """A small Maverick-shaped model (8 layers) on 16 H100s: the memory model and the
    simulator's walk agree, and the step is priced."""
    small = load(
        {
            "model_type": "llama4",
            "text_config": {**MAVERICK["text_config"], "num_hidden_layers": 8},  # type: ignore[dict-item]
        }
    )
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=16384, global_batch=32)
    layout = planner.Layout.uniform(small, pp=2, dp=8, ep=8, recompute="full")
    est = planner.evaluate(small, cluster, job, layout)
    sim = planner.simulate(small, cluster, job, layout)
    assert [m.peak_bytes for m in est.memory] == sim.peak_bytes
    assert est.step_time_s > 0


def test_a_megatron_log_with_squared_relu_reads_as_an_ungated_mlp(tmp_path: Path) -> None:
    """Megatron-LM's --squared-relu (arguments.py) prints as ``squared_relu ... True``: the
    run's MLP is up and down projections, 2 h f weights a layer, where SwiGLU has 3 h f."""
    text = (LOGS / "megatron-gpt-tp2-pp2-vp2.log").read_text()
    swiglu = "  swiglu .......................................... True"
    assert swiglu in text
    relu2 = text.replace(swiglu, "  squared_relu .................................... True")
    path = tmp_path / "relu2.log"
    path.write_text(relu2)
    gated, ungated = read_log(LOGS / "megatron-gpt-tp2-pp2-vp2.log").model, read_log(path).model
    assert (gated.mlp, ungated.mlp) == ("swiglu", "relu2")
    h, f, n = gated.hidden_size, gated.ffn_hidden_size, gated.num_layers
    assert gated.num_params() - ungated.num_params() == n * h * f


def test_torchtitan_llama4_flavors_differ_from_the_checkpoints_where_their_code_does() -> None:
    """torchtitan v0.2.2's llama4_args (torchtitan/models/llama4, 73a0e697): the same widths,
    experts and MoE layers as the Hugging Face configs, but layer i has no RoPE where i % 4 is
    0 (transformers: where (i + 1) % 4 is 0), no q/k norm (Scout's config has
    use_qk_norm true; Maverick's false), and an expert bias buffer (load_balance_coeff). The
    iRoPE flavors run FlexAttention, which its context parallelism refuses: the export runs
    cp 1 and says so."""
    import tomllib

    from planner.export.torchtitan import model_flavor

    expected = {
        "llama4-scout": (
            "17bx16e_irope",
            {"router_expert_bias", "nope_layers", "chunked_attention_layers", "qk_l2_norm"},
        ),
        "llama4-maverick": (
            "17bx128e_irope",
            {"router_expert_bias", "nope_layers", "chunked_attention_layers"},
        ),
    }
    for name, (flavor, fields) in expected.items():
        model = planner.load_model(name)
        got_name, got_flavor, unmatched = model_flavor(model, 8192)
        assert (got_name, got_flavor) == ("llama4", flavor)
        assert unmatched is not None
        listed = {
            f
            for f in planner.ModelSpec.model_fields
            if f"({f} " in unmatched or f"; {f} " in unmatched
        }
        assert listed == fields, name
    scout = planner.load_model("llama4-scout")
    cluster = planner.load_cluster("h100", gpus=64)
    job = planner.TrainingJob(seq_len=32768, global_batch=64, framework="torchtitan")
    layout = planner.Layout.uniform(scout, cp=2, dp=32, ep=8, zero=3, recompute="full")
    out = planner.export.torchtitan(plan_of(scout, cluster, job, layout))
    parallelism = tomllib.loads(out.files["torchtitan.toml"])["parallelism"]
    assert parallelism.get("context_parallel_degree", 1) == 1
    assert any("runs FlexAttention" in d for d in out.differences)


def test_nemotron4_340b_trained_layout_fits_with_its_stated_optimizer() -> None:
    """NVIDIA's Nemotron-4 340B run on 128 H100 (benchmarks/published_runs.csv, NeMo 24.07:
    TP8 PP8 VP12) with the optimizer its NeMo config states (distributed_fused_adam,
    grad_sync_dtype and dtype bf16: 2-byte gradients, moments and master weights) fits; each
    rank's state is its parameters x (2 weight + 2 gradient) bytes plus (2 master + 2 x 2
    moments) / dp 2. With FP32 gradients, master and moments (Megatron-LM's defaults) it
    would not."""
    import csv

    from planner.fit import layout_from_row

    path = Path(__file__).parents[1] / "benchmarks" / "published_runs.csv"
    with path.open(newline="") as handle:
        row = next(r for r in csv.DictReader(handle) if r["id"].startswith("nemo2407-h100-nemo"))
    row = {**row, "model": "nemotron4-340b"}
    model, job, layout = layout_from_row(row, "nemotron row")
    cluster = planner.load_cluster("h100", gpus=128)
    est = planner.evaluate(model, cluster, job, layout)
    assert est.peak_bytes <= est.cap_bytes
    first = est.memory[0]
    assert first.buckets["grads"] == 2 * first.params
    assert first.buckets["optimizer"] == pytest.approx((2 + 2 * 2) * first.params / 2, rel=1e-9)
    defaults = job.model_copy(
        update={"grad_dtype": "fp32", "moment_dtype": "fp32", "master_dtype": "fp32"}
    )
    assert planner.evaluate(model, cluster, defaults, layout).peak_bytes > est.cap_bytes


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (
            {"nope_layers": (3, 48)},
            "ModelSpec.nope_layers=[3, 48]: must be increasing layer indices in 0..47",
        ),
        (
            {"attention_chunk_size": None},
            "ModelSpec.chunked_attention_layers: set without attention_chunk_size (the chunk's "
            "tokens)",
        ),
        (
            {"sliding_window": 4096},
            "ModelSpec.attention_chunk_size=8192: chunked attention beside a sliding window is "
            "not represented; set one of them",
        ),
        (
            {"num_experts": 0, "experts_per_token": 0, "num_shared_experts": 0},
            "ModelSpec.moe_layers: set on a model without routed experts",
        ),
    ],
    ids=["nope-range", "chunks-without-size", "chunks-and-window", "moe-layers-dense"],
)
def test_inconsistent_layer_lists_are_refused(update: dict[str, object], message: str) -> None:
    fields = {**load(MAVERICK).model_dump(), **update}
    with pytest.raises(planner.PlannerError) as info:
        planner.ModelSpec(**fields)
    assert str(info.value) == message


def test_models_listing_says_which_counts_leave_a_vision_tower_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from planner.cli import main

    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["llama4-scout"]["language_model_only"] and rows["gemma3-27b"]["language_model_only"]
    assert not rows["gemma3-1b"]["language_model_only"]  # gemma3_text: no vision tower
    assert not rows["gemma2-9b"]["language_model_only"]
    assert main(["models"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "gemma3-27b, llama4-maverick, llama4-scout: the language model of a multimodal" in text


def test_a_megatron_log_states_the_precision_aware_optimizer_s_dtypes(tmp_path: Path) -> None:
    """Megatron-LM's --use-precision-aware-optimizer keeps the moments and master weights in
    --exp-avg-dtype / --exp-avg-sq-dtype and --main-params-dtype, printed as torch dtypes
    (arguments.py validate_args maps them); without the switch they stay FP32 whatever is
    printed."""
    text = (LOGS / "megatron-gpt-tp2-pp2-vp2.log").read_text()
    end = "-------------------- end of arguments ---------------------"
    lines = [
        "  exp_avg_dtype ................................... torch.bfloat16",
        "  exp_avg_sq_dtype ................................ torch.bfloat16",
        "  main_params_dtype ............................... torch.float16",
    ]
    printed_only = text.replace(end, "\n".join(lines) + "\n" + end, 1)
    on = printed_only.replace(
        end, "  use_precision_aware_optimizer ................... True\n" + end, 1
    )
    (tmp_path / "off.log").write_text(printed_only)
    (tmp_path / "on.log").write_text(on)
    off_job, on_job = (read_log(tmp_path / f"{n}.log").job for n in ("off", "on"))
    assert (off_job.moment_dtype, off_job.master_dtype) == ("fp32", "fp32")
    assert (on_job.moment_dtype, on_job.master_dtype) == ("bf16", "fp16")


def test_megatron_export_states_fp16_master_weights_and_names_bf16_ones() -> None:
    """Megatron-LM's --main-params-dtype takes fp32 or fp16 (arguments.py), under
    --use-precision-aware-optimizer with the distributed optimizer: a plan with FP16 master
    weights states it; one with BF16 master weights (NeMo's distributed_fused_adam) cannot,
    and says so."""
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster("h100", gpus=16)
    layout = planner.Layout.uniform(model, dp=16, zero=1)
    for master, stated in (("fp16", True), ("bf16", False)):
        job = planner.TrainingJob(
            seq_len=4096, global_batch=64, moment_dtype="bf16", master_dtype=master
        )
        out = planner.export.megatron(plan_of(model, cluster, job, layout))
        text = "".join(out.files.values())
        assert ("--main-params-dtype fp16" in text) is stated
        assert any("master weights bf16" in d for d in out.differences) is not stated


def test_the_cli_says_when_a_vision_tower_is_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    args = ["memory", "--cluster", "h100", "--gpus", "64", "--seq-len", "8192"]
    args += ["--global-batch", "64", "--zero", "3", "--recompute", "full"]
    main([*args, "--model", "llama4-scout", "--ep", "8"])
    said = capsys.readouterr().err
    assert "llama4-scout: the language model of a multimodal config" in said
    main([*args, "--model", "gemma2-9b"])
    assert "multimodal" not in capsys.readouterr().err
