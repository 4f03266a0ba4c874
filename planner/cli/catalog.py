"""``planner models``, ``planner clusters`` and ``planner recipes``: the catalogs, as tables or
JSON."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from planner.catalog import (
    cluster_names,
    language_model_only,
    load_cluster,
    load_model,
    model_names,
)
from planner.cli.render import GiB, catalog_cell, degrees
from planner.recipes import load_recipe, recipe_names


def catalog_command(args: argparse.Namespace) -> None:
    """``models`` or ``clusters``: each catalog entry's headline figures."""
    if args.command == "models":
        rows = [
            {
                "name": n,
                "params": (m := load_model(n)).num_params(),
                "active_params": m.num_params(active=True),
                "mtp_params": m.num_params() - m.num_params(include_mtp=False),
                "layers": m.num_layers,
                "experts": m.num_experts,
                "language_model_only": language_model_only(n),
            }
            for n in model_names()
        ]
        heads = {
            "name": "model",
            "params": "params (B)",
            "active_params": "active (B)",
            "mtp_params": "of which MTP (B)",
        }
    else:
        rows = []
        for n in cluster_names():
            c = load_cluster(n, gpus=1)
            rows.append(
                {
                    "name": n,
                    "hbm_gib": c.hbm_bytes / GiB,
                    "usable_hbm_gib": c.usable_hbm_bytes / GiB,
                    "gpus_per_node": c.gpus_per_node,
                    "nvlink_domain_gpus": c.nvlink_domain_gpus or c.gpus_per_node,
                    "nvlink_GBps": c.nvlink_Bps / 1e9,
                    "nic_GBps": c.nic_Bps / 1e9,
                }
            )
        heads = {
            "name": "machine type",
            "hbm_gib": "HBM (GiB)",
            "usable_hbm_gib": "usable (GiB)",
            "gpus_per_node": "GPUs/node",
            "nvlink_domain_gpus": "NVLink domain (GPUs)",
            "nvlink_GBps": "NVLink (GB/s/dir)",
            "nic_GBps": "NIC (GB/s/dir)",
        }
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    table = Table()
    shown = [k for k in rows[0] if k != "language_model_only"]
    for key in shown:
        table.add_column(heads.get(key, key), justify="left" if key == "name" else "right")
    for r in rows:
        table.add_row(*(catalog_cell(k, r[k]) for k in shown))
    console = Console(width=max(Console().width, 100))
    console.print(table)
    split = []
    for r in rows:
        total, mtp = r.get("params"), r.get("mtp_params")
        if isinstance(total, int) and isinstance(mtp, int) and mtp:
            main_model = catalog_cell("params", total - mtp)
            split.append(
                f"{r['name']}: {catalog_cell('params', total)}B = {main_model}B main model + "
                f"{catalog_cell('params', mtp)}B MTP"
            )
    if split:
        console.print(
            "params and active include the multi-token-prediction (MTP) modules where a config "
            "has them (num_nextn_predict_layers), their embedding and head being the main "
            f"model's, counted once: {'; '.join(split)}."
        )
    text_only = [str(r["name"]) for r in rows if r.get("language_model_only")]
    if text_only:
        console.print(
            f"{', '.join(text_only)}: the language model of a multimodal checkpoint (its "
            "text_config); the vision tower is not counted, nor planned."
        )


def recipes_command(args: argparse.Namespace) -> None:
    """``recipes``: each published layout, its machine and its measured result."""
    recipes = [load_recipe(n) for n in recipe_names()]
    rows = [
        {
            "name": r.name,
            "model": r.model.name,
            "machine": f"{r.cluster.num_gpus} x {r.cluster.name}",
            "layout": degrees(r.layout),
            "measured": r.measured,
            "source": r.source,
        }
        for r in recipes
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    table = Table(title="published layouts: planner evaluate --recipe NAME (or plan --recipe NAME)")
    for key in ("name", "model", "machine", "layout", "measured"):
        table.add_column(key)
    for r in rows:
        table.add_row(r["name"], r["model"], r["machine"], r["layout"], r["measured"])
    Console(width=max(Console().width, 132)).print(table)
