"""Where a training step's time goes: ``torch.profiler`` on the benchmark's own packed batches.

Builds the module as ``benchmarks/vs_trl.py`` does (SmolLM2-135M-Instruct, LoRA r=16 on all linear
layers, fp32 or with ``--bf16`` as ``precision: auto`` runs it where bf16 is native, fused loss,
packing), runs ``--warmup`` steps, then profiles ``--steps`` steps (forward,
backward, gradient rescale + clipping, optimizer) and prints each category's share of the CPU time
(self time of the ops in it), the wall time of each phase, the top ops, and a table of op classes
(GEMM, attention, norm, rope, casts, loss, the fused LoRA nodes' own work, autograd's elementwise
backward, the optimizer, the rest) per phase. Module options are
``key=value`` pairs (``compile_layers=true``); ``--loop-optimizer`` steps AdamW tensor by tensor,
PyTorch's CPU default, as before the module asked for ``foreach``.

    python benchmarks/step_profile.py                      # the shipped configs/lora.yaml choices
    python benchmarks/step_profile.py compile_layers=true  # one option set
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections import defaultdict

import torch

CATEGORIES = {  # first match wins, on the op name
    "GEMM": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("flash_attention", "scaled_dot_product"),
}

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}
CAST_OPS = {"aten::copy_", "aten::_to_copy"}
SCOPES = (  # (needle in an enclosing event's name, op class); the nearest enclosing match wins
    ("cat:norm", "norm"),
    ("cat:rope", "rope"),
    ("Attention", "attention"),
    ("CrossEntropy", "loss"),
    ("cat:loss", "loss"),
    ("SwiGLU", "LoRA nodes (SwiGLU, adds)"),
    ("LoRAProjections", "LoRA nodes (SwiGLU, adds)"),
    ("Backward", "autograd elementwise (norm, rope, residual)"),
)
PHASES = ("forward", "backward", "optimizer")


def op_class(event, scope_names: list[str]) -> str:
    """An op's class: GEMMs and casts by name, the rest by the nearest enclosing scope (a module's
    ``cat:`` annotation, a custom autograd node, a backward node)."""
    if event.name in GEMM_OPS:
        return "GEMM"
    if event.name in CAST_OPS:
        return "casts"
    for name in scope_names:
        for needle, which in SCOPES:
            if needle in name:
                return which
    return "other (framework, elementwise)"


def annotate(module) -> None:
    """``cat:`` scopes around each RMSNorm, the rotary embedding and its application, and the loss."""
    import sys

    def scoped(name: str, function):
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(name):
                return function(*args, **kwargs)

        return wrapped

    for sub in module.modules():
        kind = type(sub).__name__
        if kind.endswith("RMSNorm") or "RotaryEmbedding" in kind:
            sub.forward = scoped("cat:norm" if kind.endswith("RMSNorm") else "cat:rope", sub.forward)
        modeling = sys.modules.get(type(sub).__module__)
        if modeling is not None and hasattr(modeling, "apply_rotary_pos_emb"):
            function = modeling.apply_rotary_pos_emb
            if not getattr(function, "_scoped", False):
                modeling.apply_rotary_pos_emb = scoped("cat:rope", function)
                modeling.apply_rotary_pos_emb._scoped = True


def by_class(events, steps: int) -> dict[str, dict[str, float]]:
    """ms per step of each op class in each phase (self CPU time of every op)."""
    table: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        parents, parent = [], event.cpu_parent
        while parent is not None:
            parents.append(parent.name)
            parent = parent.cpu_parent
        phase = next((p.removeprefix("phase:") for p in parents if p.startswith("phase:")), None)
        if phase is None or event.name.startswith(("phase:", "cat:")):
            continue
        which = "optimizer" if phase == "optimizer" else op_class(event, [event.name, *parents])
        table[which][phase] += event.self_cpu_time_total / 1e3 / steps
    return table


def category(name: str) -> str:
    for which, needles in CATEGORIES.items():
        if any(needle in name for needle in needles):
            return which
    return "other"


def packed_batches(count: int, batch: int) -> list[dict]:
    """The benchmark's data (``vs_trl.instruction_records``) through the data module's packing."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer
    from vs_trl import instruction_records, packed_datamodule, write_jsonl

    from lit_instruct.model_names import prepare_smollm2

    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2())
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "instructions.jsonl"
        write_jsonl(data, instruction_records(count * batch, tokenizer))
        datamodule = packed_datamodule(data, batch)
        datamodule.setup("fit")
        return list(datamodule.train_dataloader())[:count]


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        options[key] = json.loads(value)
    return options


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("options", nargs="*", help="InstructLoRAModule options, key=value (JSON values)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--batch", type=int, default=None, help="samples per packed row (default: vs_trl's)")
    parser.add_argument(
        "--loop-optimizer", action="store_true", help="AdamW's per-tensor loop (torch's CPU default)"
    )
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 base weights, forward under bf16 autocast (precision: auto)"
    )
    args = parser.parse_args()

    from vs_trl import BATCH, LR, RANK, SEED

    from lit_instruct import InstructLoRAModule, LoRAConfig
    from lit_instruct.loss.fused import FusedLinearCrossEntropy
    from lit_instruct.train.module import adamw
    from lit_instruct.train.window import scale_gradients

    torch.manual_seed(SEED)
    batches = packed_batches(args.warmup + args.steps, args.batch or BATCH)
    lora = LoRAConfig(r=RANK, alpha=2 * RANK, dropout=0.0, target_modules=["all-linear"])
    options = {"dtype": "bfloat16"} if args.bf16 else {}
    options |= parse_options(args.options)
    module = InstructLoRAModule(lora=lora, learning_rate=LR, packing=True, **options)
    module.loss_fn = FusedLinearCrossEntropy()
    params = [p for p in module.parameters() if p.requires_grad]
    if args.loop_optimizer:
        optimizer = torch.optim.AdamW(params, lr=LR, foreach=False)
    else:
        optimizer = adamw(params, LR, (0.9, 0.999), 0.0)
    phases: dict[str, float] = defaultdict(float)

    annotate(module)
    loss_fn = module.loss_fn
    record = torch.profiler.record_function

    def scoped_loss(*args, **kwargs):
        with record("cat:loss"):
            return loss_fn(*args, **kwargs)

    module.loss_fn = scoped_loss

    def step(batch: dict) -> None:
        clock = time.perf_counter()
        with record("phase:forward"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss_sum, count = module.loss_sum_and_count(batch)
        phases["forward"] += time.perf_counter() - clock
        clock = time.perf_counter()
        with record("phase:backward"):
            loss_sum.backward()
        phases["backward"] += time.perf_counter() - clock
        clock = time.perf_counter()
        with record("phase:optimizer"):
            scale_gradients(params, 1.0 / count)
            torch.nn.utils.clip_grad_norm_(params, 1.0)  # what Lightning's gradient_clip_val runs
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        phases["optimizer"] += time.perf_counter() - clock

    for batch in batches[: args.warmup]:
        step(batch)
    phases.clear()
    tokens = sum(b["input_ids"].numel() for b in batches[args.warmup :])
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for batch in batches[args.warmup :]:
            step(batch)
    seconds = time.perf_counter() - start

    self_us: dict[str, float] = defaultdict(float)
    for event in profile.key_averages():
        self_us[event.key] += event.self_cpu_time_total
    total = sum(self_us.values())
    shares: dict[str, float] = defaultdict(float)
    for name, us in self_us.items():
        shares[category(name)] += us
    steps = args.steps
    print(
        f"options {parse_options(args.options)}: {tokens / seconds:.1f} tokens/s under the profiler, "
        f"{steps} steps of {tokens / steps:.0f} tokens; peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )
    print("ms/step: " + ", ".join(f"{k} {v / steps * 1e3:.0f}" for k, v in phases.items()))
    ranked = sorted(shares.items(), key=lambda kv: -kv[1])
    print("share of op self time: " + ", ".join(f"{k} {v / total:.1%}" for k, v in ranked))
    for name, us in sorted(self_us.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {us / total:6.1%} {us / 1e3 / steps:8.1f} ms/step  {name}")
    table = by_class(profile.events(), steps)
    print("\n| op class | " + " | ".join(f"{p} ms/step" for p in PHASES) + " | share |")
    print("| --- | " + " | ".join("---" for _ in PHASES) + " | --- |")
    whole = sum(sum(row.values()) for row in table.values())
    for which, row in sorted(table.items(), key=lambda kv: -sum(kv[1].values())):
        cells = " | ".join(f"{row.get(p, 0.0):.0f}" for p in PHASES)
        print(f"| {which} | {cells} | {sum(row.values()) / whole:.1%} |")


if __name__ == "__main__":
    main()
