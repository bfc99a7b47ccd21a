"""Loss + lm_head backward: naive (materialized logits) vs lit-instruct's fused CE vs Cut Cross-Entropy.

Each measurement runs in its own subprocess: a warm-up call (CCE's includes its ``torch.compile``),
then one timed forward + backward. Its peak memory is how far the resident set rose above where it
stood before that call (the kernel's peak-RSS mark, ``VmHWM``, is reset just before it through
``/proc/self/clear_refs``), so library imports and compilation do not hide or inflate it. The lm_head
is frozen, as in LoRA: the work is the loss and ``grad_hidden``. The "floor" is the two matmuls
this work needs (logits, and grad_logits @ W), timed alone on the counted rows.

    python benchmarks/fused_ce.py                                   # the full grid (slow)
    python benchmarks/fused_ce.py --hidden 2048 --vocab 128256      # the headline case
    python benchmarks/fused_ce.py --hidden 2048 --vocab 128256 --ignored 0 --impls ours cce --repeats 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from workers import run_worker

IMPLS = ("naive", "ours", "cce")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def reset_peak_rss() -> float:
    """Reset the peak-RSS mark to the current RSS; return the current RSS in MB."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _status_mb("VmRSS")


def worker(impl: str, n: int, h: int, v: int, ignored: float) -> dict[str, float]:
    """Run one case in this process and report its peak RSS and time."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = torch.randn(v, h, generator=gen) * h**-0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignored] = -100

    if impl == "naive":

        def step() -> None:
            F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100).backward()
    elif impl == "ours":
        from lit_instruct.loss.fused import fused_linear_cross_entropy

        def step() -> None:
            fused_linear_cross_entropy(hidden, weight, labels, backend="torch").backward()
    elif impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        def step() -> None:
            linear_cross_entropy(hidden, weight, labels, impl="torch_compile").backward()
    elif impl == "floor":
        kept = hidden.detach()[labels != -100]
        grad = torch.empty(len(kept), v)

        def step() -> None:
            torch.mm(kept, weight.T, out=grad)
            torch.mm(grad, weight)
    else:
        raise ValueError(impl)

    step()  # warm-up (and compile)
    hidden.grad = None
    before = reset_peak_rss()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"extra_mb": _status_mb("VmHWM") - before, "seconds": seconds}


def run_case(impl: str, n: int, h: int, v: int, ignored: float) -> dict[str, float]:
    return run_worker(__file__, impl, str(n), str(h), str(v), str(ignored))


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, nargs="+", default=[576, 2048])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--ignored", type=float, nargs="+", default=[0.0, 0.5])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--repeats", type=int, default=1, help="runs per implementation (median kept)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/fused_ce.json"))
    parser.add_argument("--worker", nargs=5, metavar=("IMPL", "N", "H", "V", "P"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, n, h, v, ignored = args.worker
        print(json.dumps(worker(impl, int(n), int(h), int(v), float(ignored))))
        return

    rows = []
    header = f"{'N':>5} {'H':>5} {'V':>6} {'ign':>4} {'impl':>6} {'time s':>7} {'x naive':>7} {'x floor':>7} "
    header += f"{'+MB':>7} {'x naive':>7}"
    print(header)
    for h in args.hidden:
        for v in args.vocab:
            for ignored in args.ignored:
                floor = run_case("floor", args.tokens, h, v, ignored)["seconds"]
                runs: dict[str, list[dict[str, float]]] = {impl: [] for impl in args.impls}
                for _ in range(args.repeats):  # alternate the implementations, keep the median
                    for impl in args.impls:
                        runs[impl].append(run_case(impl, args.tokens, h, v, ignored))
                results = {
                    impl: sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2] for impl, rs in runs.items()
                }
                naive = results.get("naive")
                for impl, r in results.items():
                    extra = r["extra_mb"]
                    row = {
                        "tokens": args.tokens,
                        "hidden": h,
                        "vocab": v,
                        "ignored": ignored,
                        "impl": impl,
                        "seconds": r["seconds"],
                        "extra_mb": extra,
                        "floor_seconds": floor,
                    }
                    if naive:
                        row["time_vs_naive"] = r["seconds"] / naive["seconds"]
                        row["memory_vs_naive"] = extra / max(naive["extra_mb"], 1e-9)
                    rows.append(row)
                    print(
                        f"{args.tokens:>5} {h:>5} {v:>6} {ignored:>4.0%} {impl:>6} {r['seconds']:>7.2f} "
                        f"{row.get('time_vs_naive', float('nan')):>7.2f} {r['seconds'] / floor:>7.2f} "
                        f"{extra:>7.0f} {row.get('memory_vs_naive', float('nan')):>7.3f}",
                        flush=True,
                    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
