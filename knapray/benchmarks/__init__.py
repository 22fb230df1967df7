"""Benchmarks that print ratios measured side by side in one run: ``knapray bench
planner|step|rivals|ledger|data|kernels|coordinator|sample|serve``, one subcommand each with only its own flags."""

from __future__ import annotations

import argparse

from knapray.commands.registry import Command, add_commands

BENCHES = (
    Command("planner", "knapray.benchmarks.planner", "imbalance and plan time, greedy vs knapray, on the paper's "
            "mixes at 32 and 1024 ranks", run="cli"),
    Command("step", "knapray.benchmarks.step", "measured per-rank compute of balanced vs unbalanced training steps "
            "(gloo processes on this machine), and FSDP / checkpointing / compile variants", run="cli"),
    Command("rivals", "knapray.benchmarks.rivals", "measured per-rank compute of the plans of every planner knapray "
            "can execute (knapray auto and per-step, KnapFormer greedy, dynamic CP, FlexSP-style) on gloo processes",
            run="cli"),
    Command("ledger", "knapray.benchmarks.ledger", "what committing one step costs at 10k, 1M and 10M ledger rows "
            "(this machine's disk)", run="cli"),
    Command("data", "knapray.benchmarks.data", "rows/s and MB/s per worker of the Ray Data and torchrun readers "
            "(before/after the zero-copy change, fp32/bf16 text) beside the rate one GPU needs", run="cli"),
    Command("kernels", "knapray.benchmarks.kernels", "a block's matrix products and attention alone at a run's "
            "shape: their model TFLOP/s and the ceiling a step could reach (GPU)", run="cli"),
    Command("coordinator", "knapray.benchmarks.coordinator", "the coordinator actor driven by simulated ranks at "
            "32 to 4096 ranks: plan latency, actor CPU, calls and bytes per step", run="cli"),
    Command("sample", "knapray.benchmarks.sample", "one denoising loop fp32 eager against bf16 compiled (the "
            "ratio), and the first-block step cache's speedup and error, at a CPU size", run="cli"),
    Command("serve", "knapray.benchmarks.serve", "a mixed request stream served by knapray's balanced plan, static "
            "USP and data parallel: p50/p99 latency and throughput at equal p99, predicted at 8 and 32 H100s "
            "(--measure: on 4 CPU ranks)", run="cli"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_commands(p, BENCHES, dest="bench")
