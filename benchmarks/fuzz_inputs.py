"""Bad and unusual input, generated: the CLI's only outcomes are a layout that fits (exit 0),
one line naming what is wrong (exit 2), or a layout that does not fit with its reason on
stderr (exit 3). Never a traceback, a hang or another exit code.

Each input is a ``planner memory`` or ``planner evaluate`` command line (the commands that
cost a stated layout, so each input is quick to check) drawn by Hypothesis: catalog models
and names that are not, machine types, GPU counts, sequence lengths and global batches from
the plausible to the absurd (zero, negative, 10^12), every degree, ZeRO stage, schedule,
recompute choice and precision the flags take and values they do not, a model config file
with a count stated as a string or an uncosted field, a machine file with a string for a
number or a negative bandwidth, a layout file that is not a layout.
``tests/test_fuzz_inputs.py`` runs a few hundred; this runs 10,000 and prints how each
ended.

Run: ``.venv/bin/python benchmarks/fuzz_inputs.py [--examples N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.data import catalog_dir

MODELS = ["llama3-8b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b", "gpt-5", ""]
CLUSTERS = ["h100", "a100", "h800", "b200", "tpu"]
SCHEDULES = ["1f1b", "interleaved", "dualpipe", "dualpipev", "zb-h1", "gpipe", "bogus"]
RECOMPUTE = ["none", "full", "selective", "op", "offload", "mla_up_proj", "moe", "core_attn+mlp"]
RECOMPUTE += ["layernorm+moe_act", "shared_experts", "nonsense", ""]
BAD_COUNTS = st.one_of(
    st.integers(min_value=-8, max_value=0), st.sampled_from([3, 7, 1000, 10**6, 10**12])
)


def mostly(
    good: st.SearchStrategy[object], bad: st.SearchStrategy[object]
) -> st.SearchStrategy[object]:
    """``good`` about nine times in ten (so that deep paths are reached), else ``bad``."""
    return st.integers(min_value=0, max_value=9).flatmap(lambda i: bad if i == 9 else good)


GPUS = mostly(st.sampled_from([8, 16, 64]), BAD_COUNTS)
DEGREES = mostly(st.sampled_from([1, 1, 2, 4, 8]), BAD_COUNTS)
BATCHES = mostly(st.sampled_from([64, 256, 1024]), BAD_COUNTS)


def config_files(folder: Path) -> list[str]:
    """Model config files the fuzz draws from: a count as a string, an uncosted field, not
    JSON, a model type no reader has."""
    base = {
        "model_type": "llama",
        "hidden_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 4096,
        "vocab_size": 32000,
    }
    cases = {
        "ok.json": base,
        "string.json": {**base, "hidden_size": "1024"},
        "softcap.json": {**base, "final_logit_softcapping": 30.0},
        "window.json": {**base, "sliding_window": 512},
        "gemma.json": {**base, "model_type": "gemma2"},
        "missing.json": {k: v for k, v in base.items() if k != "vocab_size"},
    }
    out = []
    for name, data in cases.items():
        (folder / name).write_text(json.dumps(data))
        out.append(str(folder / name))
    (folder / "broken.json").write_text("{not json")
    out.append(str(folder / "broken.json"))
    return out


def cluster_files(folder: Path) -> list[str]:
    """Machine files: the catalog's H100 as it is, and with a string for a number, a negative
    bandwidth, a fraction above 1, a missing key, broken YAML."""
    text = (catalog_dir("hardware") / "h100.yaml").read_text()
    cases = {
        "c_ok.yaml": text,
        "c_string.yaml": text.replace("hbm_bandwidth_GBps: 3350", 'hbm_bandwidth_GBps: "fast"'),
        "c_negative.yaml": text.replace("nic_Gbps: 400", "nic_Gbps: -400"),
        "c_fraction.yaml": text.replace("  gemm: 0.80", "  gemm: 3.0"),
        "c_missing.yaml": "\n".join(
            line for line in text.splitlines() if not line.startswith("gpus_per_node")
        ),
        "c_broken.yaml": "name: [unclosed\n",
    }
    out = []
    for name, body in cases.items():
        (folder / name).write_text(body)
        out.append(str(folder / name))
    return out


def layout_files(folder: Path) -> list[str]:
    """Layout files: not a layout, an infeasible plan, an empty object."""
    cases = {"lay_empty.json": {}, "lay_plan.json": {"status": "infeasible", "layout": None}}
    cases["lay_bad.json"] = {"tp": "x", "pp": 1}
    out = []
    for name, data in cases.items():
        (folder / name).write_text(json.dumps(data))
        out.append(str(folder / name))
    return out


def commands(
    files: list[str],
    layouts: list[str],
    clusters: list[str] = (),  # type: ignore[assignment]
) -> st.SearchStrategy[list[str]]:
    def flag(name: str, values: st.SearchStrategy[object]) -> st.SearchStrategy[list[str]]:
        """The flag left out three times in four, else given a value."""
        given_ = values.map(lambda v: [name, str(v)])
        return st.integers(min_value=0, max_value=3).flatmap(
            lambda i: given_ if i == 3 else st.just([])
        )

    parts = [
        st.sampled_from(["memory", "evaluate"]).map(lambda c: [c]),
        mostly(st.sampled_from(MODELS[:4]), st.sampled_from(MODELS[4:] + files)).map(
            lambda m: ["--model", str(m)]
        ),
        mostly(st.sampled_from(CLUSTERS[:4]), st.sampled_from([CLUSTERS[4], *clusters])).map(
            lambda c: ["--cluster", str(c)]
        ),
        GPUS.map(lambda n: ["--gpus", str(n)]),
        mostly(st.sampled_from([512, 4096, 8192]), st.sampled_from([0, -1, 7])).map(
            lambda n: ["--seq-len", str(n)]
        ),
        BATCHES.map(lambda n: ["--global-batch", str(n)]),
        flag("--tp", DEGREES),
        flag("--pp", DEGREES),
        flag("--ep", DEGREES),
        flag("--cp", mostly(st.sampled_from([1, 2]), st.sampled_from([3, 0]))),
        flag("--etp", mostly(st.sampled_from([1, 2]), st.just(0))),
        flag("--zero", mostly(st.sampled_from([0, 1, 2, 3]), st.just(4))),
        flag("--micro-batch", DEGREES),
        flag("--schedule", mostly(st.sampled_from(SCHEDULES[:-1]), st.just(SCHEDULES[-1]))),
        flag("--virtual-stages", mostly(st.sampled_from([1, 2, 3]), st.just(0))),
        flag("--recompute", mostly(st.sampled_from(RECOMPUTE[:8]), st.sampled_from(RECOMPUTE[8:]))),
        flag("--compute-dtype", mostly(st.sampled_from(["bf16", "fp8"]), st.just("fp4"))),
        flag("--moment-dtype", mostly(st.sampled_from(["fp32", "bf16"]), st.just("int3"))),
        flag(
            "--framework",
            mostly(st.sampled_from(["megatron", "torchtitan", "deepspeed"]), st.just("jax")),
        ),
        flag(
            "--memory-margin",
            mostly(st.sampled_from([0.0, 0.05]), st.sampled_from([0.6, -1, "nan"])),
        ),
        flag("--optimizer-offload", mostly(st.sampled_from([0, 0.5, 1]), st.just(2))),
        flag("--layout", mostly(st.nothing(), st.sampled_from(layouts))),
    ]
    return st.tuples(*parts).map(lambda ps: [a for p in ps for a in p])


def outcome(argv: list[str]) -> tuple[int, str]:
    """Run one command line in this process: its exit code and what it wrote on stderr;
    an exception out of ``main`` fails."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = int(exc.code or 0)
    return code, err.getvalue()


def check(argv: list[str], tally: Counter[str] | None = None) -> None:
    """The outcome rules of the module docstring, for one command line."""
    code, err = outcome(argv)
    assert code in (0, 2, 3), (argv, code, err)
    lines = [line for line in err.splitlines() if line.startswith("planner: ")]
    if code == 2:
        assert len(lines) == 1 and err.endswith("\n"), (argv, err)
    if code == 3:
        assert any("does not fit" in line for line in lines), (argv, err)
    assert "Traceback" not in err, (argv, err)
    if tally is not None:
        tally[str(code)] += 1


def main_(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    args = parser.parse_args(argv)
    tally: Counter[str] = Counter()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        files, layouts = config_files(Path(tmp)), layout_files(Path(tmp))
        clusters = cluster_files(Path(tmp))

        @settings(
            max_examples=args.examples,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(commands(files, layouts, clusters))
        def run(cmd: list[str]) -> None:
            check(cmd, tally)

        run()
    total = sum(tally.values())
    print(f"{total} command lines in {time.perf_counter() - started:.0f} s:")
    for code, label in (("0", "fits"), ("2", "bad input, one line"), ("3", "does not fit")):
        print(f"  exit {code} ({label}): {tally[code]}")
    print("every outcome a fitting layout, one line (exit 2) or a reason (exit 3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_())
