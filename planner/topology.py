"""The cluster as a networkx graph: GPUs, each NVLink domain's switch, NIC rails, the fabric.

Nodes carry a ``kind`` (gpu, nvswitch, nic, leaf, spine); edges carry ``bandwidth_Bps`` (per
direction) and ``latency_s``. An NVLink domain is a node's GPUs on an HGX/DGX node, and
``ClusterSpec.domain_gpus`` GPUs (several nodes, each with its own NICs) on a rack-scale
NVLink fabric such as GB200 NVL72, whose NVLink switch trays join every GPU of the rack at
full bandwidth (one switch here). A full-mesh node (``ClusterSpec.nvlink_peer_Bps``, AMD
Infinity Fabric) has no switch: each pair of its GPUs shares one direct link. The layout is
rail-optimised, as in DGX SuperPODs and DeepSeek-V3's fat-tree: NIC ``k`` of every node
connects to rail leaf switch ``k``, and the leaves to one spine layer, so GPU ``k`` of node A
reaches GPU ``k`` of node B through one leaf. A path's bottleneck bandwidth is what the
communication model reads.
"""

from __future__ import annotations

import itertools

import networkx as nx

from planner.specs import ClusterSpec


def gpu(index: int) -> str:
    """Graph name of global GPU ``index``."""
    return f"gpu{index}"


def build_topology(cluster: ClusterSpec) -> nx.Graph:
    """The cluster's graph (see the module docstring)."""
    g = nx.Graph()
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)
    domain = min(cluster.domain_gpus, cluster.num_gpus)
    nics = cluster.nics_per_node
    multi_node = cluster.num_gpus > cluster.domain_gpus  # traffic leaves the NVLink domain
    mesh = cluster.nvlink_peer_Bps
    if multi_node:
        g.add_node("spine", kind="spine")
        for rail in range(nics):
            leaf = f"leaf{rail}"
            g.add_node(leaf, kind="leaf", rail=rail)
            # Non-blocking fat tree: the leaf's uplink carries every NIC on its rail.
            g.add_edge(
                leaf,
                "spine",
                bandwidth_Bps=cluster.nic_Bps * cluster.num_nodes,
                latency_s=cluster.ib_latency_s / 2,
            )
    for node in range(cluster.num_nodes):
        for local in range(per_node):
            index = node * per_node + local
            g.add_node(gpu(index), kind="gpu", node=node, local_rank=local)
            if mesh is not None:  # a direct link to each GPU of the node already placed
                for peer in range(node * per_node, index):
                    g.add_edge(
                        gpu(peer),
                        gpu(index),
                        bandwidth_Bps=mesh,
                        latency_s=cluster.nvlink_latency_s,
                    )
            else:
                switch = f"nvswitch{index // domain}"
                if switch not in g:
                    g.add_node(switch, kind="nvswitch", node=node, domain=index // domain)
                g.add_edge(
                    gpu(index),
                    switch,
                    bandwidth_Bps=cluster.nvlink_Bps,
                    latency_s=cluster.nvlink_latency_s / 2,
                )
            if not multi_node:
                continue
            rail = local * nics // per_node  # GPUs share a NIC when there are fewer NICs
            nic = f"nic{node}.{rail}"
            if nic not in g:
                g.add_node(nic, kind="nic", node=node, rail=rail)
                g.add_edge(
                    nic,
                    f"leaf{rail}",
                    bandwidth_Bps=cluster.nic_Bps,
                    latency_s=cluster.ib_latency_s / 2,
                )
            to_nic = cluster.gpu_nic_Bps if cluster.gpu_nic_Bps is not None else cluster.pcie_Bps
            g.add_edge(gpu(index), nic, bandwidth_Bps=to_nic, latency_s=0.0)
    return g


def path_bandwidth_Bps(graph: nx.Graph, src: int, dst: int) -> float:
    """Bottleneck per-direction bandwidth of the shortest path between two GPUs (B/s)."""
    path = nx.shortest_path(graph, gpu(src), gpu(dst))
    return min(float(graph.edges[a, b]["bandwidth_Bps"]) for a, b in itertools.pairwise(path))
