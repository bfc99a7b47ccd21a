"""How long data setup takes, and how much memory, for a large generated corpus.

Generates N multi-turn chat conversations (seeded; written under ``--dir``, kept out of the
repository), then measures ``InstructDataModule.setup`` with SmolLM2's tokenizer and chat template,
each in a fresh process: the first setup with 1 and with 2 processes (``num_proc``; each into an
empty cache), and the second setup (a cache hit, memory-mapped), for N and for N/10 conversations
(the peak RSS of a cached setup should not grow with N).

``--case checksum`` times what checking a cache on open costs: the CRC-32 of every file of a
200 MB store (as the cache writes and checks it), against SHA-256 and BLAKE2b of the same bytes.

``--case long_line`` sets up 1,000 conversations and one line of 50 MB (a user turn, whose answer
truncation cuts away, or an answer, cut short), max_seq_len 1024, and reports the time and the peak
RSS (``ru_maxrss``) of each setup, in a fresh process.

    python benchmarks/data_setup.py [--conversations 100000] [--dir /tmp/lit-instruct-data-setup]
    python benchmarks/data_setup.py --case checksum
    python benchmarks/data_setup.py --case long_line
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workers import run_worker

VOCABULARY = (
    "the model data train answer question token loss batch layer weight value range small large fast slow "
    "river mountain city music colour number letter story reason simple exact"
)
WORDS = VOCABULARY.split()


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."


def generate(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` chat records of 1-3 exchanges, a system prompt in a third of them."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for i in range(n):
            messages = [{"role": "system", "content": sentence(rng, 4, 10)}] if i % 3 == 0 else []
            for turn in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": f"#{i}.{turn} " + sentence(rng, 5, 30)})
                messages.append({"role": "assistant", "content": sentence(rng, 10, 80)})
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def generate_long_line(path: Path, where: str, megabytes: int = 50) -> Path:
    """1,000 conversations, then one whose user turn (``where="context"``) or answer is ``megabytes``
    MB of text."""
    generate(path, 1_000)
    rng = random.Random(1)
    parts: list[str] = []
    while sum(map(len, parts)) < megabytes * 2**20:
        parts += [sentence(rng, 5, 30) + " " for _ in range(10_000)]
    long = "".join(parts)[: megabytes * 2**20]
    turns = [long, "Short answer."] if where == "context" else ["Write at length.", long]
    messages = [
        {"role": role, "content": text} for role, text in zip(("user", "assistant"), turns, strict=True)
    ]
    with path.open("a") as out:
        out.write(json.dumps({"messages": messages}) + "\n")
    return path


def long_line_case(folder: Path) -> None:
    """Setup of a file with one 50 MB line, its time and peak RSS."""
    print("| the 50 MB line | JSONL MiB | seconds | peak RSS MiB | samples | truncated | dropped |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for where in ("context", "answer"):
        path = folder / f"long-{where}.jsonl"
        if not path.exists():
            generate_long_line(path, where)
        r = measure(path, folder / f"cache-long-{where}", 1, fresh=True)
        counts = r["counts"]
        dropped = sum(n for name, n in counts.items() if name.startswith("dropped_"))
        label = "a user turn" if where == "context" else "the answer"
        print(
            f"| {label} | {path.stat().st_size / 2**20:.0f} | {r['seconds']:.1f} | "
            f"{r['peak_rss_mib']:.0f} | {r['samples']:,} | {counts.get('truncated', 0)} | {dropped} |"
        )


def worker(path: str, cache_dir: str, num_proc: int) -> None:
    from lit_instruct.data.datamodule import InstructDataModule

    start = time.perf_counter()
    data = InstructDataModule(
        train_files=[path], cache_dir=cache_dir, num_proc=num_proc, max_seq_len=1024, val_fraction=0.01
    )
    data.setup("fit")
    seconds = time.perf_counter() - start
    store = data.train_samples
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "samples": len(store) + len(data.val_samples),
                "store_mib": (store.nbytes + data.val_samples.nbytes) / 2**20,
                "cached": data.prepared.cached if data.prepared else False,
                "counts": dict(data.counts["train"] + data.counts["val"]),
            }
        )
    )


def measure(path: Path, cache: Path, num_proc: int, fresh: bool) -> dict:
    if fresh:
        shutil.rmtree(cache, ignore_errors=True)
    return run_worker(__file__, str(path), str(cache), str(num_proc))


def best_of(run: Callable[[], object]) -> float:
    """The fastest of three timed calls of ``run``."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def checksum_case(folder: Path, tokens: int = 25_000_000) -> None:
    """The cache's check of a store of ``tokens`` ids and labels (int32: 200 MB at the default)."""
    import numpy as np

    from lit_instruct.data.store import SampleStore, check_files, file_checksums

    rng = np.random.default_rng(0)
    lengths = np.full(tokens // 500, 500)
    ids = rng.integers(0, 49_152, tokens, dtype=np.int32)
    arrays = {
        "input_ids": ids,
        "labels": np.where(rng.random(tokens) < 0.5, ids, -100).astype(np.int32),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "full_lengths": lengths.astype(np.int64),
        "source_ids": np.zeros(len(lengths), np.int32),
        "origins": np.zeros(0, np.uint8),
        "origin_offsets": np.zeros(len(lengths) + 1, np.int64),
    }
    shutil.rmtree(folder, ignore_errors=True)
    SampleStore(arrays, ["bench"]).save(folder)
    listed = file_checksums(folder)
    mb = sum(size for size, _ in listed.values()) / 1e6
    data = b"".join((folder / name).read_bytes() for name in listed)
    rows = [
        ("CRC-32, written (file_checksums)", best_of(lambda: file_checksums(folder))),
        ("CRC-32, checked on open (check_files)", best_of(lambda: check_files(folder, listed))),
        ("SHA-256 of the same bytes", best_of(lambda: hashlib.sha256(data).digest())),
        ("BLAKE2b of the same bytes", best_of(lambda: hashlib.blake2b(data).digest())),
    ]
    print(f"| {mb:.0f} MB store (page cache warm) | seconds | MB/s |")
    print("|---|---:|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.3f} | {mb / seconds:,.0f} |")
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lit-instruct-data-setup"))
    parser.add_argument("--case", choices=("setup", "checksum", "long_line"), default="setup")
    args = parser.parse_args()
    if args.case == "checksum":
        checksum_case(args.dir / "checksum-store")
        return
    if args.case == "long_line":
        long_line_case(args.dir)
        return
    rows = []
    for n in (args.conversations // 10, args.conversations):
        path = args.dir / f"chats-{n}.jsonl"
        if not path.exists():
            generate(path, n)
        mib = path.stat().st_size / 2**20
        cache = args.dir / f"cache-{n}"
        runs = [("first, num_proc=2", measure(path, cache, 2, fresh=True))]
        if n == args.conversations:
            runs.insert(0, ("first, num_proc=1", measure(path, args.dir / "cache-1proc", 1, fresh=True)))
        runs.append(("second (cached)", measure(path, cache, 2, fresh=False)))
        for label, result in runs:
            rows.append((n, mib, label, result))
    print("| conversations | JSONL MiB | setup | seconds | peak RSS MiB | samples | store MiB |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for n, mib, label, r in rows:
        print(
            f"| {n:,} | {mib:.0f} | {label} | {r['seconds']:.1f} | {r['peak_rss_mib']:.0f} | "
            f"{r['samples']:,} | {r['store_mib']:.0f} |"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
