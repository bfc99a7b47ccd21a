"""Options tried together: every pair of levels of the factors below appears in some case (a greedy
all-pairs set, :mod:`tests.allpairs`). Each case is run as ``fit`` runs it: the config check first
(values, pairs, the model's structure on its weightless skeleton). It is either refused there, with
one line naming a setting of the case and the other setting (or the model's layers) it cannot go
with, or it trains one optimizer step on a tiny model of its family, where these always hold:

* the step's loss is finite and equals the model's own ``forward(labels=...)`` on the same
  micro-batches (a packed row: each of its samples alone), token-weighted over the accumulation;
* the coverage line's counts equal an independent count of the adapted layers and expert weights;
* no adapter outside what was asked (targets, layers), none on the output head;
* each option shows in what was built (rank, DoRA magnitudes, rsLoRA scale, LoRA+ groups, 4-bit
  layers, packed rows, grown vocabulary, micro-batches per step).

A case that passes the config check and then fails in the build or the step fails the test: what
cannot work must be refused before any weights are read.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lit_instruct.data.collate import PadCollator
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.render import Sample
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.objectives import OBJECTIVES
from lit_instruct.preflight import OBJECTIVE_CHECKED, check_config, config_settings
from lit_instruct.rules import flatten, refuse_conflicts
from lit_instruct.train.module import InstructLoRAModule
from tests.allpairs import all_pairs
from tests.families import build_family
from tests.helpers import trainer

VOCAB = 49152
R = 4
FACTORS: dict[str, list[Any]] = {
    "family": ["llama", "qwen3_moe", "lfm2"],  # dense, MoE, hybrid (short convolutions + attention)
    "format": ["chat", "sharegpt", "alpaca", "prompt_completion"],
    "template": [None, "chatml", "alpaca"],
    "packing": [False, True],
    "streaming": [False, True],
    "turns": [("auto", "answers"), ("per_turn", "answers"), ("last", "answers"), ("joint", "all")],
    "targets": [
        ("all-linear", None),
        ("q_proj,v_proj", None),
        ("self_attn.q_proj", None),
        ("all-linear", [1]),
    ],
    "variant": [None, "dora", "rslora", "loraplus"],
    "init": ["default", "gaussian", "pissa", "olora", "eva", "loftq"],
    "quantization": ["none", "nf4"],
    "strategy": ["one_device", "auto"],
    "accumulation": [1, 2],
    "new_tokens": [None, ["<|fact|>"]],
    "precision": ["32-true", "bf16-mixed"],  # bf16: the base stored in bf16 (model.dtype: auto)
    "checkpointing": [False, True],
    "objective": ["sft", "dpo", "kto", "grpo"],  # conversations, pairs, answers with KL rows, prompts
    "neftune": [None, 5.0],  # NEFTune's alpha (SFT only): the reference draws the step's own noise
}
BETA = 0.1
"""The pair objectives' β (their defaults)."""
GRPO_BETA = 0.04
GRPO = {
    "class_path": "GRPO",
    "init_args": {
        "rewards": ["tests.preference_ddp_fit:length_reward"],
        "num_generations": 2,
        "max_completion_length": 4,
        "beta": GRPO_BETA,
    },
}
"""GRPO sampling 2 completions of up to 4 tokens per prompt from the policy, with a KL term."""
BF16_LOSS = 2e-2
"""The step's loss under bf16 vs the model's own under the same autocast: both round every GEMM to
8 mantissa bits, in different places (the fused loss and LoRA layers vs peft's and the model's)."""

CHATS = [
    [("user", "What is the capital of France?"), ("assistant", "Paris, the city of light.")],
    [
        ("user", "Say hello."),
        ("assistant", "Hello there!"),
        ("user", "Louder."),
        ("assistant", "HELLO THERE!"),
    ],
    [("system", "Answer in one word."), ("user", "Colour of the sky?"), ("assistant", "Blue, mostly.")],
    [("user", "Two plus two?"), ("assistant", "Four, as always.")],
    [("user", "Name a fruit."), ("assistant", "An apple, crunchy and sweet.")],
    [("user", "Spell cat."), ("assistant", "C-A-T, three letters.")],
]


def record(chat: list[tuple[str, str]], fmt: str) -> dict[str, Any]:
    """``chat`` as a record of ``fmt``."""
    if fmt == "chat":
        return {"messages": [{"role": r, "content": c} for r, c in chat]}
    if fmt == "sharegpt":
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": names[r], "value": c} for r, c in chat]}
    system = next((c for r, c in chat if r == "system"), None)
    user, answer = [c for r, c in chat if r == "user"][-1], [c for r, c in chat if r == "assistant"][-1]
    if fmt == "alpaca":
        return {"instruction": user, "input": "", "output": answer, **({"system": system} if system else {})}
    return {"prompt": user, "completion": answer}


def pair_record(chat: list[tuple[str, str]], other: list[tuple[str, str]]) -> dict[str, Any]:
    """A pair: ``chat``'s last question, its answer chosen, ``other``'s answer rejected."""
    user = [c for r, c in chat if r == "user"][-1]
    return {"prompt": user, "chosen": chat[-1][1], "rejected": other[-1][1]}


def settings_of(case: dict[str, Any], model: str, data_file: str) -> dict[str, Any]:
    """The ``fit`` config (as LightningCLI parses it) of ``case`` (its data: the pairs file for an
    objective on pairs or answers; the CLI links ``data.batch_kind`` from ``model.objective``)."""
    targets, layers = case["targets"]
    multi_turn, train_on = case["turns"]
    lora: dict[str, Any] = {"r": R, "alpha": 8.0, "target_modules": targets.split(","), "init": case["init"]}
    lora |= {"layers_to_transform": layers} if layers else {}
    lora |= {"use_dora": True} if case["variant"] == "dora" else {}
    lora |= {"use_rslora": True} if case["variant"] == "rslora" else {}
    lora |= {"loraplus_lr_ratio": 4.0} if case["variant"] == "loraplus" else {}
    bf16 = case["precision"] == "bf16-mixed"
    quantization = {"method": case["quantization"], "compute_dtype": "bfloat16" if bf16 else "float32"}
    return {
        "model": {
            "model": model,
            "dtype": "bfloat16" if bf16 else "float32",
            "gradient_checkpointing": case["checkpointing"],
            "lora": lora,
            "quantization": quantization,
            "packing": case["packing"],
            "learning_rate": 1e-3,
            "warmup_steps": 0,
            "objective": GRPO if case["objective"] == "grpo" else case["objective"],
            "neftune_noise_alpha": case["neftune"],
        },
        "data": {
            "tokenizer": model,
            "train_files": [data_file],
            "chat_template": case["template"],
            "packing": case["packing"],
            "streaming": case["streaming"],
            "multi_turn": multi_turn,
            "train_on": train_on,
            "new_tokens": case["new_tokens"],
            "batch_size": 3,
            "val_fraction": 0.0,
            "cache": False,
            "batch_kind": OBJECTIVES[case["objective"]].batch_kind,
        },
        "trainer": {
            "strategy": case["strategy"],
            "accumulate_grad_batches": case["accumulation"],
            "precision": case["precision"],
            "max_steps": 1,
        },
    }


def refused_by_structure(case: dict[str, Any]) -> bool:
    """What the model's structure refuses (known here to steer the generator, judged by the check):
    LFM2's convolutions mix packed samples; Qwen3-MoE's experts are adapted through their weight,
    which DoRA and the decomposing inits cannot do."""
    experts = case["family"] == "qwen3_moe" and case["targets"][0] == "all-linear"
    return (case["packing"] and case["family"] == "lfm2") or (
        experts and (case["variant"] == "dora" or case["init"] in ("pissa", "olora", "eva"))
    )


def statically_accepted(case: dict[str, Any]) -> bool:
    """What the generator steers by: cases that neither the table of refused pairs nor the model's
    structure refuses."""
    if refused_by_structure(case):
        return False
    settings = flatten(settings_of(case, "m", "d"))
    try:
        refuse_conflicts(settings)
        model = {name: settings[f"model.{name}"] for name in OBJECTIVE_CHECKED if f"model.{name}" in settings}
        arguments = GRPO["init_args"] if case["objective"] == "grpo" else {}
        OBJECTIVES[case["objective"]](**arguments).check(model)
    except ConfigError:
        return False
    return True


def needed(case: dict[str, Any]) -> dict[str, Any]:
    """The levels another level needs: LoftQ an NF4 base."""
    return {"quantization": "nf4"} if case["init"] == "loftq" else {}


CASES, LONE = all_pairs(FACTORS, statically_accepted, seed=0, fill=needed)


def case_id(case: dict[str, Any]) -> str:
    targets, layers = case["targets"]
    parts = [
        case["family"],
        case["format"],
        str(case["template"] or "own"),
        case["init"],
        case["quantization"],
    ]
    parts += ["packed" * case["packing"], "streamed" * case["streaming"], "-".join(case["turns"]), targets]
    parts += [f"layers{layers}" if layers else "", str(case["variant"] or ""), case["strategy"]]
    parts += [f"accum{case['accumulation']}", "newtok" if case["new_tokens"] else ""]
    parts += ["bf16" if case["precision"] == "bf16-mixed" else "", "gc" if case["checkpointing"] else ""]
    parts += [case["objective"] if case["objective"] != "sft" else "", "neftune" if case["neftune"] else ""]
    return "/".join(p for p in parts if p)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> dict[str, Path]:
    """Each family's tiny model, with SmolLM2's tokenizer (and chat template) beside it."""
    dirs = {}
    for family in FACTORS["family"]:
        path = build_family(family, VOCAB, tmp_path_factory.mktemp(family))
        tokenizer.save_pretrained(path)
        dirs[family] = path
    return dirs


@pytest.fixture(scope="module")
def data_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pairwise-data")
    files = {}
    for fmt in FACTORS["format"]:
        files[fmt] = folder / f"{fmt}.jsonl"
        files[fmt].write_text("".join(json.dumps(record(chat, fmt)) + "\n" for chat in CHATS * 2))
    files["pairs"] = folder / "pairs.jsonl"
    pairs = [pair_record(chat, CHATS[(k + 1) % len(CHATS)]) for k, chat in enumerate(CHATS)]
    files["pairs"].write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    files["prompts"] = folder / "prompts.jsonl"
    prompts = [{"prompt": [c for r, c in chat if r == "user"][-1], "answer": "4"} for chat in CHATS]
    files["prompts"].write_text("".join(json.dumps(prompt) + "\n" for prompt in prompts))
    return files


def sequence_logps(model: Any, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens, from the model's own full logits."""
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"], use_cache=False).logits
    labels = rows["labels"][:, 1:]
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logps.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return (picked * (labels != IGNORE_INDEX)).sum(dim=1)


def policy_and_reference(module: Any, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' summed log-probabilities under the policy and under the reference (the adapter off,
    eval mode), from the model's own forward."""
    policy = sequence_logps(module.model, rows)
    was_training = module.model.training
    module.model.eval()
    with module.model.disable_adapter():
        reference = sequence_logps(module.model, rows)
    module.model.train(was_training)
    return policy, reference


def pair_objective_losses(objective: str, module: Any, batch: dict[str, Any]) -> tuple[float, int]:
    """DPO's (sigmoid) or KTO's summed loss over a batch and its pairs (answers), from the model's
    own forward: TRL's formulas, written out here."""
    rows = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    policy, reference = policy_and_reference(module, rows)
    ratios = policy - reference
    if objective == "dpo":
        n = len(ratios) // 2
        losses = -torch.nn.functional.logsigmoid(BETA * (ratios[:n] - ratios[n:]))
        return float(losses.sum()), n
    n = len(batch["desirable"])
    kl = ratios[n:].mean().clamp(min=0)
    desirable = batch["desirable"]
    losses = torch.where(
        desirable, 1 - torch.sigmoid(BETA * (ratios[:n] - kl)), 1 - torch.sigmoid(BETA * (kl - ratios[:n]))
    )
    return float(losses.sum()), n


def token_logps(model: Any, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each labelled token's log-probability and the entropy of the distribution it was drawn from,
    ``(rows, width - 1)`` each (0 elsewhere), from the model's own full logits."""
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"], use_cache=False).logits
    labels = rows["labels"][:, 1:]
    scored = labels != IGNORE_INDEX
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    entropies = -(logps.exp() * logps).sum(-1)
    return logps.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * scored, entropies * scored


def grpo_loss(module: Any, batch: dict[str, Any], completions: list[Any]) -> tuple[float, float, int]:
    """GRPO's summed loss (``dapo``: over the completion tokens) on the completions the policy sampled
    for ``batch``'s prompts, from the model's own forward: TRL's formulas, written out here. On policy
    the ratio is 1: each token's loss is minus its completion's group-normalized advantage plus β
    times the KL estimate ``exp(ref - logp) - (ref - logp) - 1`` to the adapter-off reference. (With
    completions of one length the advantages' part sums to 0: the summed entropy is returned too.)"""
    from tests.preference_ddp_fit import length_reward

    g = GRPO["init_args"]["num_generations"]
    prompts = [p for p in batch["prompt_ids"] for _ in range(g)]
    rewards = torch.tensor(length_reward(None, None, [c.ids for c in completions])).view(-1, g)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    width = max(len(p) + len(c.ids) for p, c in zip(prompts, completions, strict=True))
    ids, mask, labels = [], [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        row = prompt + completion.ids
        pad = width - len(row)
        ids.append(row + [0] * pad)
        mask.append([1] * len(row) + [0] * pad)
        labels.append([IGNORE_INDEX] * len(prompt) + completion.ids + [IGNORE_INDEX] * pad)
    rows = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    rows["labels"] = torch.tensor(labels)
    policy, entropies = token_logps(module.model, rows)
    was_training = module.model.training
    module.model.eval()
    with module.model.disable_adapter():
        reference, _ = token_logps(module.model, rows)
    module.model.train(was_training)
    scored = rows["labels"][:, 1:] != IGNORE_INDEX
    delta = reference - policy
    per_token = -advantages[:, None] + GRPO_BETA * (torch.exp(delta) - delta - 1)
    return float((per_token * scored).sum()), float(entropies.sum()), int(scored.sum())


class RecordingSampler:
    """The objective's own sampler (the policy's ``generate``), keeping what it sampled last."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.last: list[Any] = []

    def sample(self, model, prompt_ids, num_generations, seed):
        self.last = self.sampler.sample(model, prompt_ids, num_generations, seed)
        return self.last


class StepReference(L.Callback):
    """The model's own loss on each micro-batch of the first optimizer step, before that step (the
    pair objectives: their formulas on the model's own log-probabilities; GRPO: its formula on the
    completions the policy sampled, once they are sampled, before the backward)."""

    def __init__(self, precision: str, objective: str = "sft") -> None:
        self.objective = objective
        self.precision = precision
        self.sums: list[float] = []
        self.counts: list[int] = []
        self.packed: list[bool] = []
        self.batch: dict[str, Any] = {}
        self.entropy_sums: list[float] = []

    def on_before_backward(self, trainer: L.Trainer, module: Any, loss: torch.Tensor) -> None:
        if trainer.global_step > 0 or self.objective != "grpo":
            return
        bf16 = self.precision == "bf16-mixed"
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss_sum, entropy_sum, count = grpo_loss(module, self.batch, module.objective.sampler.last)
        self.sums.append(loss_sum)
        self.entropy_sums.append(entropy_sum)
        self.counts.append(count)

    def on_train_batch_start(
        self, trainer: L.Trainer, module: Any, batch: dict[str, Any], batch_idx: int
    ) -> None:
        if trainer.global_step > 0:
            return
        self.packed.append("packed_segments" in batch)
        if self.objective == "grpo":  # its completions are not sampled yet
            self.batch = batch
            return
        bf16 = self.precision == "bf16-mixed"
        state = torch.get_rng_state()  # NEFTune: the step then draws the noise this forward drew
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            self._reference(module, batch)
        torch.set_rng_state(state)

    def _reference(self, module: Any, batch: dict[str, Any]) -> None:
        if self.objective != "sft":
            loss_sum, count = pair_objective_losses(self.objective, module, batch)
            self.sums.append(loss_sum)
            self.counts.append(count)
            return
        for sample_batch in _alone(batch):
            count = int((sample_batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            if count:
                loss = module.model(**sample_batch, use_cache=False).loss
                self.sums.append(float(loss) * count)
                self.counts.append(count)

    @property
    def loss(self) -> float:
        return sum(self.sums) / sum(self.counts)

    @property
    def entropy(self) -> float:
        return sum(self.entropy_sums) / sum(self.counts)


def _alone(batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """A padded batch as it is; a packed row as each of its samples alone."""
    if "packed_segments" not in batch:
        return [{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}]
    bounds = batch["packed_segments"]
    out = []
    for start, end in itertools.pairwise(bounds):
        ids = batch["input_ids"][0, start:end].tolist()
        out.append(PadCollator(0)([Sample(ids, batch["labels"][0, start:end].tolist(), "s")]))
    return [{k: b[k] for k in ("input_ids", "attention_mask", "labels")} for b in out]


def adapted(module: InstructLoRAModule) -> tuple[list[str], list[str]]:
    """Independently of the coverage line: the names of the adapted 2-D weights (linear layers, by
    module or by weight) and 3-D expert weights, from what peft put in the model."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    linear, experts = [], []
    for name, layer in module.model.base_model.model.named_modules():
        if not isinstance(layer, LoraLayer) or "default" not in layer.lora_A:
            continue
        if isinstance(layer, ParamWrapper):
            weight = layer.get_param()
            (experts if weight.dim() == 3 else linear).append(f"{name}.{layer.parameter_name}")
        else:
            linear.append(name)
    return linear, experts


def assert_within_request(case: dict[str, Any], names: list[str], module: InstructLoRAModule) -> None:
    targets, layers = case["targets"]
    head = next(n for n, m in module.model.base_model.model.named_modules() if m is module.lm_head)
    for name in names:
        stem = re.sub(r"\.(weight|gate_up_proj|down_proj)$", "", name) if "experts" not in name else name
        assert not stem.startswith(head), name
        if targets != "all-linear":
            assert any(stem == t or stem.endswith(f".{t}") for t in targets.split(",")), name
        if layers:
            index = re.search(r"\.layers\.(\d+)\.", name)
            assert index is not None and int(index.group(1)) in layers, name


def assert_options_show(case: dict[str, Any], module: InstructLoRAModule, trained: L.Trainer) -> None:
    from peft.tuners.lora.layer import LoraLayer

    layers = [m for m in module.model.modules() if isinstance(m, LoraLayer) and "default" in m.lora_A]
    if case["init"] != "eva":  # EVA redistributes the ranks
        assert {m.r["default"] for m in layers} == {R}
    if case["variant"] == "dora":
        assert all(
            "default" in m.lora_magnitude_vector for m in layers if hasattr(m, "lora_magnitude_vector")
        )
    if case["variant"] == "rslora":  # EVA keeps alpha / r at the asked ratio (peft's adjust_scaling_factors)
        for m in layers:
            rank = m.r["default"]
            alpha = 8.0 * rank / R if case["init"] == "eva" else 8.0
            assert m.scaling["default"] == pytest.approx(alpha / math.sqrt(rank))
    if case["variant"] == "loraplus":
        groups = trained.optimizers[0].param_groups
        assert len(groups) == 2 and groups[1]["initial_lr"] == pytest.approx(4.0 * groups[0]["initial_lr"])
    if case["quantization"] == "nf4":
        import bitsandbytes as bnb

        assert any(isinstance(m, bnb.nn.Linear4bit) for m in module.model.modules())
    if case["new_tokens"]:
        assert module.base_model.get_input_embeddings().weight.shape[0] > VOCAB
    if case["precision"] == "bf16-mixed" and case["quantization"] == "none":
        assert module.lm_head.weight.dtype == torch.bfloat16
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # adapters and their state: fp32
    if case["checkpointing"]:
        assert module.base_model.is_gradient_checkpointing
    embeddings = module.base_model.get_input_embeddings()
    assert getattr(embeddings, "neftune_noise_alpha", None) == case["neftune"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_a_combination_trains_right_or_is_refused_at_config_time(
    case: dict[str, Any], family_dirs: dict[str, Path], data_files: dict[str, Path], tmp_path: Path
) -> None:
    model = str(family_dirs[case["family"]])
    files = {"sft": case["format"], "grpo": "prompts"}
    data_file = data_files[files.get(case["objective"], "pairs")]
    config = settings_of(case, model, str(data_file))
    settings = config_settings(config)
    expected_refusal = not statically_accepted(case)
    try:
        check_config(config)
    except ConfigError as refusal:
        text = str(refusal)
        leaves = [k for k, v in settings.items() if not isinstance(v, dict)] + ["model.objective"]
        named = {k for k in leaves if re.search(rf"(^|\W){re.escape(k)}\b", text)}
        assert "\n" not in text and text.startswith(tuple(f"{k}: " for k in named)), text
        assert len(named) >= 2, text  # the setting and what it cannot go with (a setting or the model)
        assert expected_refusal, f"refused, though nothing in the case should be: {text}"
        return
    assert not expected_refusal, "not refused at config time"
    L.seed_everything(0)
    data = InstructDataModule(**config["data"])
    module = InstructLoRAModule(**config["model"], added_tokens=data.new_token_list())
    if case["objective"] == "grpo":  # the policy's own generate, recorded for the reference
        module.objective.bind(data.load_tokenizer())
        module.objective.sampler = RecordingSampler(module.objective.sampler)
    reference = StepReference(case["precision"], case["objective"])
    run = trainer(
        tmp_path,
        max_steps=1,
        precision=case["precision"],
        accumulate_grad_batches=case["accumulation"],
        strategy=case["strategy"],
        callbacks=[reference],
        limit_val_batches=0,
    )
    run.fit(module, datamodule=data)
    loss = float(run.callback_metrics["train/loss"])
    assert math.isfinite(loss)
    rel = BF16_LOSS if case["precision"] == "bf16-mixed" else 1e-4
    assert loss == pytest.approx(reference.loss, rel=rel, abs=1e-6 if case["objective"] == "grpo" else 0)
    if case["objective"] == "grpo":  # its loss is ~0 on policy with completions of one length
        assert float(run.callback_metrics["train/entropy"]) == pytest.approx(reference.entropy, rel=rel)
    assert len(reference.packed) == case["accumulation"] and set(reference.packed) == {case["packing"]}
    linear, experts = adapted(module)
    expected = f"LoRA: {len(linear)} of {len(linear)} linear layers"
    expected += f", {len(experts)} of {len(experts)} expert weights" if experts else ""
    assert module.model.lora_coverage.line().startswith(expected)
    assert_within_request(case, linear + experts, module)
    assert_options_show(case, module, run)


def test_the_pairwise_set_covers_every_pair_in_few_cases() -> None:
    """Every pair of levels of two factors is in a case (counted here, not by the generator), and
    the pairs no accepted case holds are exactly the ones refused together."""
    names = sorted(FACTORS)
    missing = [
        (a, x, b, y)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for x, y in itertools.product(FACTORS[a], FACTORS[b])
        if not any(case[a] == x and case[b] == y for case in CASES)
    ]
    assert missing == []
    assert len(CASES) < 70
    for (a, i), (b, j) in LONE:
        alone = [c for c in CASES if c[a] == FACTORS[a][i] and c[b] == FACTORS[b][j]]
        assert alone and not any(statically_accepted(c) for c in alone), (a, i, b, j)
