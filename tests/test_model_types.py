"""The Hugging Face model types of current models: parameter counts against published totals,
the costs of their attention windows and biases, and the refusal of fields no reader costs.

Sources of the totals (the row of each model names its own):
- [HF] Hugging Face safetensors-metadata totals (https://huggingface.co/api/models/<repo>
  ?expand[]=safetensors), as quoted by third-party repos (see models/index.yaml); for the
  models here they count parameters only (BF16 files, or MXFP4 experts counted per value).
- [Q25] Qwen2.5-72B(-Instruct) model card: "Number of Parameters: 72.7B".
- [Q3] Qwen3-32B model card: "Number of Parameters: 32.8B".
- [Q3M] Qwen3-235B-A22B model card: "235B in total and 22B activated".
- [OSS] OpenAI, gpt-oss-120b & gpt-oss-20b Model Card (arXiv 2508.10925), Table 1: total
  116.83B / 20.91B; active 5.13B / 3.61B, "Unembedding parameters are counted towards active,
  but not embeddings".
- [K2] Kimi K2 model card (github.com/MoonshotAI/Kimi-K2, Model Summary): 1T total, 32B
  activated.
- [M7] Mistral 7B (Jiang et al. 2023, arXiv 2310.06825) section 2: with window W, "each
  token can attend to at most W tokens"; the hidden state at position i attends to positions
  i - W .. i of the layer below.
"""

from __future__ import annotations

import json

import pytest

import planner
from planner.cli import main
from planner.costs.blocks import CAUSAL, Shard, attended_share, block_cost

EXACT = [
    # (catalog name, total parameters, source)
    ("qwen2.5-72b", 72_706_203_648, "[HF] Qwen/Qwen2.5-72B-Instruct; [Q25] 72.7B"),
    ("qwen3-32b", 32_762_123_264, "[HF] Qwen/Qwen3-32B; [Q3] 32.8B"),
    ("qwen3-235b-a22b", 235_093_634_560, "[HF] Qwen/Qwen3-235B-A22B; [Q3M] 235B"),
    ("gpt-oss-120b", 116_829_156_672, "[HF] openai/gpt-oss-120b; [OSS] 116.83B"),
    ("gpt-oss-20b", 20_914_757_184, "[HF] openai/gpt-oss-20b; [OSS] 20.91B"),
    ("mistral-7b", 7_241_732_096, "[HF] mistralai/Mistral-7B-v0.1"),
]


@pytest.mark.parametrize(("name", "total", "source"), EXACT, ids=[e[0] for e in EXACT])
def test_total_parameters_match_the_published_checkpoint(
    name: str, total: int, source: str
) -> None:
    assert planner.load_model(name).num_params() == total, source


def test_kimi_k2_total() -> None:
    """[HF] moonshotai/Kimi-K2-Instruct stores 1,026,408,235,864 elements: the parameters,
    the 60 MoE layers' e_score_correction_bias buffers (384 each, not parameters), and 3,416
    elements that an independent reconstruction from the config could not place either.
    [K2] rounds the total to 1T. No MTP module: num_nextn_predict_layers is 0."""
    kimi = planner.load_model("kimi-k2")
    assert kimi.num_mtp_layers == 0
    assert kimi.num_params() + 60 * 384 == pytest.approx(1_026_408_235_864, abs=3_416)
    assert round(kimi.num_params() / 1e12) == 1
    # [K2]'s 32B active matches the count without the input embedding (31.7B), as [OSS] counts
    embedding = kimi.vocab_size * kimi.hidden_size
    assert round((kimi.num_params(active=True) - embedding) / 1e9) == 32


@pytest.mark.parametrize(("name", "active"), [("gpt-oss-120b", 5.13e9), ("gpt-oss-20b", 3.61e9)])
def test_gpt_oss_active_parameters(name: str, active: float) -> None:
    """[OSS] Table 1 counts the unembedding as active but not the embedding; num_params
    counts both, so the embedding table comes off. Rounded to 0.01B as the table is."""
    model = planner.load_model(name)
    embedding = model.vocab_size * model.hidden_size
    assert model.num_params(active=True) - embedding == pytest.approx(active, abs=0.005e9)


def test_qwen3_moe_active_parameters() -> None:
    """[Q3M]: 22B activated of 235B (8 of 128 experts, no shared expert)."""
    assert round(planner.load_model("qwen3-235b-a22b").num_params(active=True) / 1e9) == 22


def test_dotted_catalog_name_loads_under_its_name() -> None:
    assert planner.load_model("qwen2.5-72b").name == "qwen2.5-72b"


# ---------------------------------------------------------------------------------------
# biases, now counted for Llama-type configs (transformers' LlamaAttention: q, k, v and o
# take bias=attention_bias; LlamaMLP: gate, up and down take bias=mlp_bias)

LLAMA = json.loads((planner.catalog.MODELS_DIR / "llama3-8b.json").read_text())


def test_llama_attention_and_mlp_biases_are_counted() -> None:
    base = planner.load_model(LLAMA).num_params()
    attn = planner.load_model({**LLAMA, "attention_bias": True}).num_params()
    mlp = planner.load_model({**LLAMA, "mlp_bias": True}).num_params()
    # 32 layers; q 4096 + k 1024 + v 1024 + o 4096 outputs; gate and up 14336, down 4096
    assert attn - base == 32 * (4096 + 1024 + 1024 + 4096)
    assert mlp - base == 32 * (2 * 14336 + 4096)


# ---------------------------------------------------------------------------------------
# sliding windows


def pairs(seq: int, window: int) -> float:
    """[M7]: query p attends to min(p+1, window) keys; less half the diagonal band (window/2
    pairs), the convention under which full causal attention counts seq^2/2 of seq(seq+1)/2."""
    return sum(min(p + 1, window) for p in range(seq)) - min(window, seq) / 2


@pytest.mark.parametrize(("seq", "window"), [(512, 128), (300, 64), (256, 256), (128, 512)])
def test_attended_share_counts_the_window(seq: int, window: int) -> None:
    assert attended_share(seq, window) * seq**2 == pytest.approx(pairs(seq, window))
    assert attended_share(seq, None) == CAUSAL


def test_mistral_window_cuts_flash_attention_flops_only() -> None:
    """Mistral-7B-v0.1 (window 4096, 32 heads x 128) at 8192 tokens: QK^T and PV each cost
    2 * heads * d FLOPs per attended pair. Flash attention keeps no score matrix, so the saved
    bytes do not change; unfused attention computes and keeps the whole matrix either way."""
    mistral = planner.load_model("mistral-7b")
    full = mistral.model_copy(update={"sliding_window": None})
    s, w = 8192, 4096
    flash = Shard(seq_len=s)
    windowed = block_cost(mistral, "layer.0", flash)
    assert windowed.fwd.attention == pytest.approx(4 * 32 * 128 * pairs(s, w))
    assert block_cost(full, "layer.0", flash).fwd.attention == pytest.approx(
        4 * 32 * 128 * s * s * CAUSAL
    )
    assert windowed.saved_bytes() == block_cost(full, "layer.0", flash).saved_bytes()
    unfused = Shard(seq_len=s, flash_attention=False)
    with_window, without = (
        block_cost(mistral, "layer.0", unfused),
        block_cost(full, "layer.0", unfused),
    )
    assert with_window.fwd.flops == without.fwd.flops
    assert with_window.saved_bytes() == without.saved_bytes()
    # no shorter sequence than the window is cut
    short = Shard(seq_len=w)
    assert block_cost(mistral, "layer.0", short).fwd == block_cost(full, "layer.0", short).fwd


def test_gpt_oss_alternates_windowed_and_full_layers() -> None:
    """[OSS]: layers alternate a 128-token band and dense attention; 64 heads of 64."""
    oss = planner.load_model("gpt-oss-120b")
    assert [oss.attention_window(i) for i in range(4)] == [128, None, 128, None]
    s = 4096
    banded, dense = (block_cost(oss, f"layer.{i}", Shard(seq_len=s)) for i in (0, 1))
    assert banded.fwd.attention == pytest.approx(4 * 64 * 64 * pairs(s, 128))
    assert dense.fwd.attention == pytest.approx(4 * 64 * 64 * s * s * CAUSAL)
    assert {p.key.split(".", 2)[-1]: p.numel for p in banded.params} == {
        p.key.split(".", 2)[-1]: p.numel for p in dense.params
    }


# ---------------------------------------------------------------------------------------
# fields no reader costs are refused, one line, naming the field and value


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {**LLAMA, "sliding_window": 4096},
            "model config custom: sliding_window=4096 is not supported (attention to a window "
            "of keys; the llama reader does not cost it)",
        ),
        (
            {
                **json.loads((planner.catalog.MODELS_DIR / "qwen3-32b.json").read_text()),
                "use_sliding_window": True,
            },
            "model config custom: use_sliding_window=true is not supported (which layers get "
            "the window depends on max_window_layers, which transformers reads two ways "
            "(issue #35896); set it false)",
        ),
        (
            {
                **json.loads((planner.catalog.MODELS_DIR / "qwen3-235b-a22b.json").read_text()),
                "mlp_only_layers": [0, 1],
            },
            "model config custom: mlp_only_layers=[0, 1] is not supported (only [], every "
            "layer MoE, is costed)",
        ),
        (
            {**LLAMA, "final_logit_softcapping": 30.0},
            "model config custom: final_logit_softcapping=30.0 is not supported (a tanh soft "
            "cap on the logits; the llama reader does not cost it)",
        ),
        (
            {**LLAMA, "hidden_size": str(LLAMA["hidden_size"])},
            f'model config custom: hidden_size="{LLAMA["hidden_size"]}" must be a whole '
            "number (a JSON number, not a string)",
        ),
        (
            {**LLAMA, "rms_norm_eps": "1e-5"},
            'model config custom: rms_norm_eps="1e-5" must be a number (a JSON number, not a '
            "string)",
        ),
    ],
    ids=[
        "llama-window",
        "qwen3-window",
        "qwen3-moe-dense-layers",
        "gemma-softcap-under-llama",
        "width-as-string",
        "epsilon-as-string",
    ],
)
def test_uncosted_fields_are_refused(cfg: dict[str, object], message: str) -> None:
    with pytest.raises(planner.PlannerError) as info:
        planner.load_model(cfg)
    assert str(info.value) == message


def test_harmless_fields_pass() -> None:
    """rope_scaling changes no cost; inert values of costly fields (null window, false
    biases) pass too."""
    cfg = {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "sliding_window": None}
    assert planner.load_model(cfg).num_params() == planner.load_model(LLAMA).num_params()


# ---------------------------------------------------------------------------------------
# the catalog listing says what DeepSeek-V3's total holds


def test_models_listing_splits_out_the_mtp_module(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V3 report (arXiv 2412.19437): 671B in the main model; the MTP module adds
    the rest of the 682.6B the catalog counts."""
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    v3 = rows["deepseek-v3"]
    assert v3["params"] - v3["mtp_params"] == pytest.approx(671e9, abs=0.5e9)
    assert rows["kimi-k2"]["mtp_params"] == 0
    assert main(["models"]) == 0
    text = "".join(capsys.readouterr().out.split())
    assert "deepseek-v3:682.6B=671.0Bmainmodel+11.6BMTP" in text
