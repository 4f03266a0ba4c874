"""Every catalog file loads; bad names, files and GPU counts give one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planner
import planner.data
from planner.catalog import (
    ACHIEVED_KINDS,
    ACHIEVED_MAX_KINDS,
    HARDWARE_DIR,
    INDEX_KEYS,
    MACHINE_KEYS,
    MODELS_DIR,
    SOURCE_KEYS,
    model_index,
)
from planner.data import CATALOGS, catalog_dir, package_file
from planner.fit import CONSTANTS as FIT_CONSTANTS
from planner.topology import build_topology, path_bandwidth_Bps

MODEL_NAMES = planner.model_names()
CLUSTER_NAMES = planner.cluster_names()


def test_catalogs_hold_what_was_promised() -> None:
    for name in ("deepseek-v3", "deepseek-v2", "llama3-8b", "llama3-70b", "llama3-405b"):
        assert name in MODEL_NAMES
    for name in ("mixtral-8x7b", "mixtral-8x22b", "gpt3-175b", "qwen2-57b-a14b"):
        assert name in MODEL_NAMES
    assert set(CLUSTER_NAMES) >= {"a100", "h100", "h800", "h200", "b200"}


@pytest.mark.parametrize("name", MODEL_NAMES, ids=MODEL_NAMES)
def test_every_model_loads_and_is_indexed(name: str) -> None:
    model = planner.load_model(name)
    assert model.num_params() > model.num_params(active=True) or not model.num_experts
    entry = model_index()[name]  # every file says where it comes from
    assert entry["file"] == f"{name}.json" and entry["source"]


def test_the_index_names_only_catalog_files() -> None:
    assert sorted(model_index()) == MODEL_NAMES


@pytest.mark.parametrize("name", CLUSTER_NAMES, ids=CLUSTER_NAMES)
def test_every_cluster_loads_with_sources(name: str) -> None:
    import yaml

    cluster = planner.load_cluster(name, gpus=16)
    raw = yaml.safe_load((HARDWARE_DIR / f"{name}.yaml").read_text())
    assert cluster.num_nodes == 16 // raw["gpus_per_node"]
    numeric = [k for k, v in raw.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    numeric += [f"achieved.{k}" for k in raw["achieved"]]
    missing = [k for k in numeric if k not in raw["sources"]]
    assert not missing, f"{name}: no source for {missing}"


def test_load_model_reads_paths_and_dicts(tmp_path: Path) -> None:
    path = MODELS_DIR / "llama3-8b.json"
    from_path = planner.load_model(str(path))
    from_dict = planner.load_model(json.loads(path.read_text()))
    assert from_path.num_params() == from_dict.num_params() == 8_030_261_248
    spec_dict = from_path.model_dump()
    assert planner.load_model(spec_dict).num_params() == 8_030_261_248


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(planner.PlannerError, match=r"unknown model name; known: deepseek-v2, "):
        planner.load_model("gpt-5")


def test_missing_config_key_is_named(tmp_path: Path) -> None:
    cfg = json.loads((MODELS_DIR / "llama3-8b.json").read_text())
    del cfg["intermediate_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(planner.PlannerError, match="missing key 'intermediate_size'") as info:
        planner.load_model(str(path))
    assert "\n" not in str(info.value)


def test_malformed_config_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(planner.PlannerError, match="malformed") as info:
        planner.load_model(str(path))
    assert "\n" not in str(info.value)


def test_unknown_cluster() -> None:
    with pytest.raises(planner.PlannerError, match="unknown cluster name; known: a100"):
        planner.load_cluster("tpu-v5", gpus=8)


@pytest.mark.parametrize("gpus", [12, 2052])
def test_gpu_count_must_be_whole_nodes_above_one_node(gpus: int) -> None:
    with pytest.raises(planner.PlannerError, match=f"num_gpus={gpus}: above one node"):
        planner.load_cluster("h100", gpus=gpus)


def test_partial_single_node_is_allowed() -> None:
    assert planner.load_cluster("h100", gpus=4).num_nodes == 1


@pytest.mark.parametrize("gpus", [0, -8, 2**24 + 8])
def test_gpu_count_must_be_positive_and_bounded(gpus: int) -> None:
    with pytest.raises(planner.PlannerError, match=r"must be a whole number of GPUs from 1 to"):
        planner.load_cluster("h100", gpus=gpus)


def test_units_are_converted_once() -> None:
    h800 = planner.load_cluster("h800", gpus=8)
    assert h800.hbm_bytes == 80 * 2**30
    assert h800.nic_Bps == 50e9  # 400 Gb/s
    assert h800.nvlink_Bps == 200e9
    assert h800.bf16_flops == pytest.approx(989.4e12)


# Usable HBM: the device total the CUDA runtime reports, as public PyTorch OOM messages print
# it ("GPU 0 has a total capacity of X GiB"); the H800 is taken as the H100 80GB HBM3 (same
# memory, same nvidia-smi total of 81559 MiB). Sources: hardware/*.yaml (usable_hbm_GiB) and
# hardware/README.md, "Usable HBM"; NVML figures: https://thundergolfer.com/blog/nvidia-gpu-memory-capacity
USABLE_GIB = {
    "a100": 79.14,
    "h100": 79.15,
    "h800": 79.15,
    "h200": 139.80,
    "b200": 178.35,
    "h100-96gb": 94.99,  # torchtitan's logged GiB over its logged share of the device total
    "gb200": 184.31,
    "b300": 267.69,
    "gb300": 277.55 - (268.59 - 267.69),  # a convention: nvidia-smi's total less the B300's gap
    "mi300x": 191.98,  # the HIP runtime's total, as PyTorch's OOM message prints it
    "mi355x": 287.98,
}


@pytest.mark.parametrize("name", CLUSTER_NAMES, ids=CLUSTER_NAMES)
def test_every_cluster_states_usable_hbm_below_nominal(name: str) -> None:
    import yaml

    raw = yaml.safe_load((HARDWARE_DIR / f"{name}.yaml").read_text())
    assert "usable_hbm_GiB" in raw["sources"]
    cluster = planner.load_cluster(name, gpus=8)
    assert cluster.usable_hbm_bytes == round(USABLE_GIB[name] * 2**30)
    assert cluster.usable_hbm_bytes < cluster.hbm_bytes


def test_usable_hbm_above_nominal_is_a_one_line_error(tmp_path: Path) -> None:
    h100 = planner.load_cluster("h100", gpus=8)
    with pytest.raises(planner.PlannerError) as info:
        planner.ClusterSpec(**{**h100.model_dump(), "hbm_reserved_bytes": h100.hbm_bytes})
    assert str(info.value) == (
        f"ClusterSpec.hbm_reserved_bytes={h100.hbm_bytes}: must be below "
        f"hbm_bytes={h100.hbm_bytes} (some HBM must be left to allocate)"
    )
    text = (HARDWARE_DIR / "h100.yaml").read_text()
    path = tmp_path / "h100-wrong.yaml"
    path.write_text(text.replace("usable_hbm_GiB: 79.15", "usable_hbm_GiB: 81"))
    with pytest.raises(planner.PlannerError, match=r"usable_hbm_GiB=81 must be in") as info:
        planner.load_cluster(str(path), gpus=8)
    assert "\n" not in str(info.value)


def test_usable_hbm_defaults_to_nominal_when_left_out() -> None:
    fields = planner.load_cluster("h100", gpus=8).model_dump()
    del fields["hbm_reserved_bytes"]
    assert planner.ClusterSpec(**fields).usable_hbm_bytes == 80 * 2**30


def test_topology_keeps_nvlink_inside_a_node_and_ib_across() -> None:
    cluster = planner.load_cluster("h800", gpus=32)
    graph = cluster.topology()
    assert graph.number_of_nodes() == build_topology(cluster).number_of_nodes()
    assert sum(1 for _, d in graph.nodes(data=True) if d["kind"] == "gpu") == 32
    assert path_bandwidth_Bps(graph, 0, 7) == cluster.nvlink_Bps
    assert path_bandwidth_Bps(graph, 0, 8) == cluster.nic_Bps  # same rail, one leaf
    assert path_bandwidth_Bps(graph, 1, 8) == cluster.nic_Bps  # rail change via the spine


def test_gpt_neox_format() -> None:
    """EleutherAI/gpt-neox-20b's config.json shape; Black et al. 2022 ("GPT-NeoX-20B: An
    Open-Source Autoregressive Language Model"), section 2: 20,554,567,680 parameters."""
    cfg = {
        "model_type": "gpt_neox",
        "hidden_size": 6144,
        "num_hidden_layers": 44,
        "num_attention_heads": 64,
        "intermediate_size": 24576,
        "vocab_size": 50432,
        "rotary_pct": 0.25,
        "tie_word_embeddings": False,
    }
    assert planner.load_model(cfg).num_params() == 20_554_567_680


def test_gpt2_format() -> None:
    """openai-community/gpt2's config.json shape: the published 124M model has 124,439,808
    parameters (tied embedding and head, learned positions)."""
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12}
    cfg |= {"n_positions": 1024, "vocab_size": 50257}
    assert planner.load_model(cfg).num_params() == 124_439_808


def test_unsupported_format_names_the_supported_ones() -> None:
    with pytest.raises(planner.PlannerError, match="model_type='t5' is not supported; supported"):
        planner.load_model({"model_type": "t5"})


def test_optional_overheads_are_read_in_microseconds(tmp_path: Path) -> None:
    source = (HARDWARE_DIR / "a100.yaml").read_text()
    path = tmp_path / "a100-measured.yaml"
    path.write_text(source + "kernel_overhead_us: 35\nhost_overhead_us: 65\n")
    cluster = planner.load_cluster(path, gpus=8)
    assert cluster.kernel_overhead_s == pytest.approx(35e-6)
    assert cluster.host_overhead_s == pytest.approx(65e-6)
    assert planner.load_cluster("a100", gpus=8).host_overhead_s == pytest.approx(70e-6)
    unstated = tmp_path / "a100-unstated.yaml"  # neither stated: the defaults
    lines = source.splitlines(keepends=True)
    unstated.write_text("".join(x for x in lines if not x.startswith("host_overhead_us")))
    default = planner.load_cluster(unstated, gpus=8)
    assert (default.kernel_overhead_s, default.host_overhead_s) == (4e-6, 0.0)


def test_a_frameworks_own_host_time_round_trips_and_is_charged(tmp_path: Path) -> None:
    from planner.catalog import cluster_yaml
    from planner.costs.compute import Rates

    source = (HARDWARE_DIR / "h100.yaml").read_text()
    path = tmp_path / "h100-fitted.yaml"
    path.write_text(source + "framework_host_overhead_us:\n  megatron: 180\n")
    cluster = planner.load_cluster(path, gpus=8)
    assert cluster.framework_host_overhead_s == {"megatron": pytest.approx(180e-6)}
    assert cluster_yaml(cluster)["framework_host_overhead_us"] == {"megatron": 180}
    job = planner.TrainingJob(seq_len=1024, global_batch=8)
    assert Rates.of(cluster, job).host_s == pytest.approx(180e-6)  # Megatron-LM's own
    torchtitan = job.with_framework("torchtitan")
    assert Rates.of(cluster, torchtitan).host_s == cluster.host_overhead_s  # the machine's
    bad = tmp_path / "h100-bad.yaml"
    bad.write_text(source + "framework_host_overhead_us:\n  megatorn: 180\n")
    with pytest.raises(planner.PlannerError, match=r"framework_host_overhead_s\.megatorn"):
        planner.load_cluster(bad, gpus=8)


# -- where the catalogs are ---------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", CATALOGS)
def test_the_located_catalog_holds_every_file_of_the_repository(kind: str) -> None:
    def files(folder: Path) -> list[str]:
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())

    assert files(catalog_dir(kind)) == files(REPO / kind)


def test_the_catalogs_list_every_file_of_the_repository() -> None:
    listed = (planner.model_names(), planner.cluster_names(), planner.recipe_names())
    globs = (("models", "*.json"), ("hardware", "*.yaml"), ("models/recipes", "*.yaml"))
    assert listed == tuple(sorted(p.stem for p in (REPO / d).glob(g)) for d, g in globs)


def test_an_installed_catalog_comes_first_and_a_checkout_needs_its_pyproject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site-packages" / "planner"
    package.mkdir(parents=True)
    monkeypatch.setattr(planner.data, "_package", lambda: package)
    (tmp_path / "site-packages" / "models").mkdir()  # another distribution's top-level folder
    with pytest.raises(planner.PlannerError, match="catalog 'models': not found at ") as info:
        catalog_dir("models")
    assert "\n" not in str(info.value)
    (tmp_path / "site-packages" / "pyproject.toml").write_text("")  # now a checkout
    assert catalog_dir("models") == tmp_path / "site-packages" / "models"
    (package / "_catalog" / "models").mkdir(parents=True)  # as the wheel installs it
    assert catalog_dir("models") == package / "_catalog" / "models"
    assert package_file("accuracy.json") == package / "accuracy.json"


# -- catalog files are strict: an unknown key is an error, never a default ----------------


def _machine_with(tmp_path: Path, section: str | None, key: str) -> Path:
    """h100.yaml with ``key`` added at the top level or in ``section``."""
    import yaml

    data = yaml.safe_load((HARDWARE_DIR / "h100.yaml").read_text())
    (data[section] if section else data)[key] = 0.5
    path = tmp_path / "h100-typo.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("section", "key", "allowed"),
    [
        (None, "pcei", MACHINE_KEYS),
        ("achieved", "pcei", ACHIEVED_KINDS),
        ("achieved_max", "pcie", ACHIEVED_MAX_KINDS),
        ("sources", "achieved.pcei", SOURCE_KEYS),
    ],
    ids=["top", "achieved", "achieved_max", "sources"],
)
def test_a_misspelt_machine_key_is_one_line_naming_file_key_and_allowed(
    tmp_path: Path, section: str | None, key: str, allowed: tuple[str, ...]
) -> None:
    path = _machine_with(tmp_path, section, key)
    with pytest.raises(planner.PlannerError) as info:
        planner.load_cluster(path, gpus=8)
    where = f" in {section}" if section else ""
    assert str(info.value) == (
        f"cluster file {path}: unknown key {key!r}{where}; allowed: {', '.join(allowed)}"
    )


def test_machine_keys_cover_what_the_readers_read() -> None:
    assert "pcie_GBps_per_direction" in MACHINE_KEYS and "pcei" not in MACHINE_KEYS
    assert {"achieved.pcie", "achieved_max.gemm", "host_memory_GBps"} <= set(SOURCE_KEYS)
    # fit.py caps each fraction it fits by achieved_max: those kinds, no others.
    fitted = {c.key for c in FIT_CONSTANTS if c.fraction}
    assert set(ACHIEVED_MAX_KINDS) == fitted and fitted <= set(ACHIEVED_KINDS)


@pytest.mark.parametrize("kind", ACHIEVED_KINDS)
def test_every_allowed_achieved_kind_is_read_by_the_cost_model(kind: str) -> None:
    # Two nodes (IB), tp 2 (NVLink), the optimizer stepped on the host (PCIe, host memory);
    # FP8 GEMMs and FlashAttention-2 where the kind is theirs.
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster("h100", gpus=16)
    dtype = "fp8" if kind == "gemm_fp8" else "bf16"
    kernel = "fa2" if kind == "attention_fa2" else "fused"
    job = planner.TrainingJob(
        seq_len=4096, global_batch=64, compute_dtype=dtype, attention_kernel=kernel
    )
    layout = planner.Layout.uniform(model, tp=2, dp=8, optimizer_offload=1.0)
    slower = {**cluster.achieved, kind: cluster.achieved[kind] / 100}
    base = planner.evaluate(model, cluster, job, layout).step_time_s
    slow = planner.evaluate(model, cluster.model_copy(update={"achieved": slower}), job, layout)
    assert slow.step_time_s > base


def test_a_misspelt_index_key_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "index.yaml"
    path.write_text("llama3-8b:\n  file: llama3-8b.json\n  sorce: https://example.org\n")
    with pytest.raises(planner.PlannerError) as info:
        model_index(path)
    assert str(info.value) == (
        f"model index {path}: unknown key 'sorce' in llama3-8b; allowed: {', '.join(INDEX_KEYS)}"
    )


def test_a_machine_file_with_a_string_for_a_number_is_one_line(tmp_path: Path) -> None:
    text = (planner.catalog.HARDWARE_DIR / "h100.yaml").read_text()
    path = tmp_path / "m.yaml"
    path.write_text(text.replace("hbm_bandwidth_GBps: 3350", 'hbm_bandwidth_GBps: "fast"'))
    with pytest.raises(planner.PlannerError, match=r"hbm_bandwidth_GBps='fast' must be a number$"):
        planner.load_cluster(path, gpus=8)
