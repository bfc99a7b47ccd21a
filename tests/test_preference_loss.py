"""Preference losses (lit_instruct.loss.preference) against TRL's own trainers on the same token ids.

TRL's ``DPOTrainer`` (every one of its ``loss_type`` values, weighted lists of them such as RPO and
MPO, ``ld_alpha``, the f-divergences, a zero reference), ``CPOTrainer`` (sigmoid with label
smoothing, SimPO) and ``ORPOTrainer`` each compute their loss and metrics on a batch built in their
collated layout from our pairs' ids; ours computes the same from hidden states through
:func:`answer_logps` on the same peft model. Loss, TRL-named metrics and LoRA gradients must agree
(fp32, rtol 1e-5). ``answer_logps`` itself is checked against a float64 ``log_softmax``.

The DPO cases share one ``DPOTrainer``, given each case's settings as its ``__init__`` takes them
from ``DPOConfig``. TRL 1.16 has no ``dpo_loss`` of its own (the loss types are branches of its
``_compute_loss``), so every case runs that method on random per-token log-probabilities, given by
the model and reference it calls (milliseconds a case); sigmoid, IPO and RPO also run end to end on
the tiny model (~4 s each), and MPO and LD-DPO on SmolLM2 (``tests/test_preference_smollm2.py``).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.answer_logps import PairLogps, answer_logps, answer_token_logps
from lit_instruct.loss.dpo_losses import DPO_LOSSES
from lit_instruct.loss.logits import LogitTransform
from lit_instruct.loss.preference import PreferenceConfig, PreferenceLoss, mean_metrics

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
LOGPS_METRICS = ("logps/chosen", "logps/rejected")
PAIRS = [
    ("What is the capital of France?", "Paris.", "London, I believe."),
    ("Say hello.", "Hello!", "No."),
    ("Name a fruit.", "An apple, which is crunchy and sweet.", "A carrot."),
]


# ---------------------------------------------------------------------------- answer_logps


def _reference_logps(hidden, weight, bias, labels, transform):
    """float64 ``log_softmax(transform(hidden @ weight.T + bias))`` gathered at the labels, summed."""
    logits = transform(hidden.double() @ weight.double().T + bias.double())
    per_token = torch.log_softmax(logits, dim=-1).gather(2, labels.clamp(min=0)[..., None]).squeeze(2)
    return (per_token * (labels != IGNORE_INDEX)).sum(dim=1)


@pytest.mark.parametrize(
    "transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0)], ids=["plain", "softcap"]
)
@pytest.mark.parametrize("chunk_size", [3, None], ids=["chunked", "one-chunk"])
def test_answer_logps_values_and_gradients(transform, chunk_size):
    gen = torch.Generator().manual_seed(0)
    batch, length, width, vocab = 4, 9, 16, 50
    hidden = torch.randn(batch, length, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) / 4
    bias = torch.randn(vocab, generator=gen)
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    labels[torch.rand(batch, length, generator=gen) < 0.4] = IGNORE_INDEX
    labels[2] = IGNORE_INDEX  # a sequence with nothing scored sums to 0
    cotangent = torch.randn(batch, generator=gen)

    ours = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logps = answer_logps(ours[0], ours[1], labels, chunk_size, bias=ours[2], transform=transform)
    (logps * cotangent).sum().backward()
    theirs = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    expected = _reference_logps(*theirs[:2], theirs[2], labels, transform)
    (expected * cotangent.double()).sum().backward()

    assert logps.dtype == torch.float32 and logps[2] == 0
    torch.testing.assert_close(logps.double(), expected.detach(), **TOLERANCE)
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.grad.double(), reference.grad, **TOLERANCE)


def test_answer_logps_keeps_no_logits_for_backward():
    """Nothing of ``[scored rows, vocab]`` size is saved for backward: chunks are recomputed."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 64, 8, generator=gen, requires_grad=True)
    weight = torch.randn(1000, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 64), generator=gen)
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logps = answer_logps(hidden, weight, labels, chunk_size=16)
    logps.sum().backward()
    assert saved and max(saved) < 16 * 1000  # less than one chunk's logits; the whole would be 128 x 1000
    assert hidden.grad is not None and weight.grad is not None


# ---------------------------------------------------------------------------- the pair losses vs TRL


@pytest.fixture(scope="module")
def pair_ids(tokenizer) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token ids: the prompt through the chat template, answers + end."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for prompt, chosen, rejected in PAIRS:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        answer = [
            tokenizer(text, add_special_tokens=False)["input_ids"] + [end] for text in (chosen, rejected)
        ]
        rows.append((list(prompt_ids), *answer))
    return rows


def _padded(rows: list[list[int]], width: int, value: int) -> torch.Tensor:
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])


def _layout(pair_ids, pad_id: int) -> dict[str, torch.Tensor]:
    """The pairs as one ``[chosen rows; rejected rows]`` batch: ids, attention, answer labels, and
    whole-sequence labels (TRL's ORPO NLL); right padding."""
    sequences = [p + c for p, c, _ in pair_ids] + [p + r for p, _, r in pair_ids]
    answers = [[0] * len(p) + [1] * len(c) for p, c, _ in pair_ids] + [
        [0] * len(p) + [1] * len(r) for p, _, r in pair_ids
    ]
    width = max(map(len, sequences))
    input_ids = _padded(sequences, width, pad_id)
    attention_mask = _padded([[1] * len(s) for s in sequences], width, 0)
    completion_mask = _padded(answers, width, 0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "labels": input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX),
        "sequence_labels": input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX),
    }


def _pair_batch(layout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same batch in CPO/ORPO's collated layout (``chosen_*``, ``rejected_*``)."""
    batch = {}
    for side, rows in (("chosen", slice(0, len(PAIRS))), ("rejected", slice(len(PAIRS), None))):
        batch[f"{side}_input_ids"] = layout["input_ids"][rows]
        batch[f"{side}_attention_mask"] = layout["attention_mask"][rows]
        batch[f"{side}_labels"] = layout["labels"][rows]
    return batch


def _perturb_lora(model: torch.nn.Module, seed: int = 0, scale: float = 0.5) -> None:
    """Random LoRA B matrices (standard deviation ``scale``), so that the policy differs from the
    reference."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * scale)


def _lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _sequence_logps(peft_model, layout, labels: torch.Tensor, ld_alpha: float | None = None) -> PairLogps:
    """Ours: the trunk's hidden states, shifted, through the chunked lm_head path (LD-DPO's sums
    with ``ld_alpha``)."""
    causal_lm = peft_model.get_base_model()
    hidden = causal_lm.model(
        input_ids=layout["input_ids"], attention_mask=layout["attention_mask"], use_cache=False
    ).last_hidden_state
    shifted = labels[:, 1:]
    per_token = answer_token_logps(hidden[:, :-1], causal_lm.lm_head.weight, shifted, chunk_size=8)
    return PairLogps.from_tokens(per_token, shifted, ld_alpha)


def _ours(peft_model, layout, loss: PreferenceLoss, orpo_sequence_nll: bool = False):
    """Our loss and per-batch metrics on ``layout``, the reference being the adapter switched off."""
    reference = None
    if loss.needs_reference:
        with torch.no_grad(), peft_model.disable_adapter():
            reference = _sequence_logps(peft_model, layout, layout["labels"], loss.ld_alpha)
    policy = _sequence_logps(peft_model, layout, layout["labels"], loss.ld_alpha)
    nll = None
    if orpo_sequence_nll:  # TRL's ORPO takes the NLL over the whole chosen sequence, prompt included
        whole = _sequence_logps(peft_model, layout, layout["sequence_labels"])
        nll = whole.chosen_nll()
    value, metrics = loss(policy, reference, chosen_nll=nll)
    return value, mean_metrics(metrics)


def _trl_dataset():
    from datasets import Dataset

    prompts, chosen, rejected = zip(*PAIRS, strict=True)
    return Dataset.from_dict({"prompt": list(prompts), "chosen": list(chosen), "rejected": list(rejected)})


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def _load(model: Path | torch.nn.Module):
    """``model`` itself, or the fp32 model loaded from its folder."""
    from transformers import AutoModelForCausalLM

    if isinstance(model, torch.nn.Module):
        return model
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)


def _dpo_trainer(model, tokenizer, tmp_path, *, dataset=None, peft_config=None, **config):
    """TRL's ``DPOTrainer`` on ``model`` (a folder or a loaded model, which gets the adapter), by
    default on :data:`PAIRS` with :func:`_lora_config`'s adapter; ``config``: ``DPOConfig``'s."""
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        precompute_ref_log_probs=False,
        per_device_train_batch_size=len(PAIRS),
        **config,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=_load(model),
            args=args,
            train_dataset=dataset if dataset is not None else _trl_dataset(),
            processing_class=tokenizer,
            peft_config=peft_config or _lora_config(),
        )
    trainer.model.train()
    return trainer


def _compare(trl_loss, trl_metrics, trl_grads, ours_loss, ours_metrics, ours_grads, names):
    torch.testing.assert_close(ours_loss, trl_loss.detach(), **TOLERANCE)
    for name in names:
        # a reward is beta times the difference of two summed log-probs (in the hundreds, fp32, summed
        # in another order than TRL's full logits): each sum carries ~1e-5 of absolute rounding, so a
        # reward's bound is absolute too, 1e-5 (the real SmolLM2 batch differs by 1.1e-6 on one CPU)
        tolerance = dict(rel=1e-5, abs=1e-5 if name.startswith("rewards/") else 1e-6)
        assert ours_metrics[name] == pytest.approx(trl_metrics[name], **tolerance), name
    assert trl_grads.keys() == ours_grads.keys() and trl_grads
    for name, grad in trl_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, **TOLERANCE)


def _trl_loss_types() -> list[str]:
    """The loss types ``DPOConfig.loss_type``'s help lists (TRL 1.16)."""
    import dataclasses
    import re

    from trl import DPOConfig

    (loss_type,) = (f for f in dataclasses.fields(DPOConfig) if f.name == "loss_type")
    return re.findall(r"`'(\w+)'`", loss_type.metadata["help"])


DPO_CASES = {  # TRL's DPOConfig settings, ours; one case per loss type of TRL 1.16, then the others
    "sigmoid": (dict(loss_type=["sigmoid"], beta=0.1), PreferenceLoss("dpo", beta=0.1)),
    "hinge": (dict(loss_type="hinge", beta=0.05), PreferenceLoss(beta=0.05, loss_type="hinge")),
    "ipo": (dict(loss_type=["ipo"], beta=0.3), PreferenceLoss("ipo", beta=0.3)),
    "exo_pair": (
        dict(loss_type="exo_pair", beta=0.1, label_smoothing=1e-3),
        PreferenceLoss(beta=0.1, loss_type="exo_pair", label_smoothing=1e-3),
    ),
    "nca_pair": (dict(loss_type="nca_pair", beta=0.1), PreferenceLoss(beta=0.1, loss_type="nca_pair")),
    "robust": (
        dict(loss_type="robust", beta=0.1, label_smoothing=0.2),
        PreferenceLoss(beta=0.1, loss_type="robust", label_smoothing=0.2),
    ),
    "bco_pair": (dict(loss_type="bco_pair", beta=0.1), PreferenceLoss(beta=0.1, loss_type="bco_pair")),
    "sppo_hard": (dict(loss_type="sppo_hard", beta=0.1), PreferenceLoss(beta=0.1, loss_type="sppo_hard")),
    "aot": (
        dict(loss_type="aot", beta=0.1, label_smoothing=0.1),
        PreferenceLoss(beta=0.1, loss_type="aot", label_smoothing=0.1),
    ),
    "aot_unpaired": (
        dict(loss_type="aot_unpaired", beta=0.1),
        PreferenceLoss(beta=0.1, loss_type="aot_unpaired"),
    ),
    "apo_zero": (dict(loss_type="apo_zero", beta=0.1), PreferenceLoss(beta=0.1, loss_type="apo_zero")),
    "apo_down": (dict(loss_type="apo_down", beta=0.1), PreferenceLoss(beta=0.1, loss_type="apo_down")),
    "discopop": (
        dict(loss_type="discopop", beta=0.1, discopop_tau=0.5),
        PreferenceLoss(beta=0.1, loss_type="discopop", discopop_tau=0.5),
    ),
    "sft": (dict(loss_type="sft"), PreferenceLoss(loss_type="sft")),
    "sigmoid_norm": (
        dict(loss_type="sigmoid_norm", beta=2.0),
        PreferenceLoss(beta=2.0, loss_type="sigmoid_norm"),
    ),
    "ipo-as-loss-type": (dict(loss_type="ipo", beta=0.3), PreferenceLoss(beta=0.3, loss_type="ipo")),
    "rpo": (
        dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.7], beta=0.2),
        PreferenceLoss("dpo", beta=0.2, rpo_alpha=0.7),
    ),
    "mpo": (
        dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0], beta=0.1),
        PreferenceLoss(beta=0.1, loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    ),
    "ld-dpo": (dict(loss_type="sigmoid", ld_alpha=0.5), PreferenceLoss(ld_alpha=0.5)),
    "ld-dpo-0-with-sft": (  # the sft term over every chosen token, not LD-DPO's weighted sums
        dict(loss_type=["sigmoid", "sft"], ld_alpha=0.0),
        PreferenceLoss(loss_type=["sigmoid", "sft"], ld_alpha=0.0),
    ),
    "forward_kl": (
        dict(loss_type="sigmoid", f_divergence_type="forward_kl"),
        PreferenceLoss(f_divergence_type="forward_kl"),
    ),
    "js_divergence-hinge": (
        dict(loss_type="hinge", beta=0.05, f_divergence_type="js_divergence"),
        PreferenceLoss(beta=0.05, loss_type="hinge", f_divergence_type="js_divergence"),
    ),
    "alpha_divergence-ipo": (
        dict(loss_type="ipo", beta=0.3, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
        PreferenceLoss(
            beta=0.3, loss_type="ipo", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3
        ),
    ),
    "reference-free": (  # TRL: a precomputed reference of zeros
        dict(
            loss_type=["sigmoid", "apo_zero"],
            loss_weights=[1.0, 0.5],
            beta=0.01,
            precompute_ref_log_probs=True,
        ),
        PreferenceLoss(
            beta=0.01, loss_type=["sigmoid", "apo_zero"], loss_weights=[1.0, 0.5], reference_free=True
        ),
    ),
}


def test_every_trl_loss_type_is_ours_and_compared():
    assert sorted(DPO_LOSSES) == sorted(_trl_loss_types())
    assert set(_trl_loss_types()) <= set(DPO_CASES)


LOSS_SETTINGS = (  # DPOConfig's fields that DPOTrainer.__init__ copies for its loss
    "beta",
    "precompute_ref_log_probs",
    "loss_type",
    "loss_weights",
    "ld_alpha",
    "f_divergence_type",
    "f_alpha_divergence_coef",
    "label_smoothing",
    "discopop_tau",
)


@pytest.fixture(scope="module")
def dpo_trainer(tiny_model_dir, tokenizer, tmp_path_factory):
    """One ``DPOTrainer`` for every DPO case (and its config's defaults); :func:`_configure` gives it
    each case's settings."""
    trainer = _dpo_trainer(tiny_model_dir, tokenizer, tmp_path_factory.mktemp("dpo"))
    return trainer, {name: getattr(trainer.args, name) for name in LOSS_SETTINGS}


def _configure(trainer, defaults: dict, **config) -> None:
    """``trainer`` with the loss settings ``DPOConfig(**config)`` gives, set as ``DPOTrainer.__init__``
    sets them. (A second ``DPOConfig`` would reset accelerate's state under the built trainer, so its
    ``__post_init__``'s two lines for these fields are repeated here.)"""
    args = {**defaults, **config}
    assert args.keys() == defaults.keys()
    if isinstance(args["loss_type"], str):
        args["loss_type"] = [args["loss_type"]]
    assert args["loss_weights"] is None or len(args["loss_weights"]) == len(args["loss_type"])
    trainer.beta = args["beta"]
    trainer.precompute_ref_logps = args["precompute_ref_log_probs"]
    trainer.loss_types = args["loss_type"]
    trainer.loss_weights = args["loss_weights"] or [1.0] * len(trainer.loss_types)
    trainer.ld_alpha = args["ld_alpha"]
    trainer.f_divergence_type = args["f_divergence_type"]
    trainer.f_alpha_divergence_coef = args["f_alpha_divergence_coef"]
    trainer.label_smoothing = args["label_smoothing"]
    trainer.args.discopop_tau = args["discopop_tau"]


ON_THE_MODEL = ("sigmoid", "ipo", "rpo")
"""The DPO cases also compared end to end on the tiny model (about 4 s each: TRL's lm_head pass
computes its entropy metrics over the 49k vocabulary at every position); every case is compared on
log-probabilities below, through the same ``DPOTrainer._compute_loss``."""


@pytest.mark.parametrize("case", ON_THE_MODEL)
def test_dpo_matches_trl_dpo_trainer(case, dpo_trainer, tokenizer, pair_ids):
    trl_config, ours_loss = DPO_CASES[case]
    trainer, defaults = dpo_trainer
    _configure(trainer, defaults, **trl_config)
    model = trainer.model
    _perturb_lora(model)
    layout = _layout(pair_ids, tokenizer.pad_token_id)

    trl_inputs = {k: layout[k] for k in ("input_ids", "attention_mask", "completion_mask")}
    trl_loss = trainer._compute_loss(model, trl_inputs, return_outputs=False)
    trl_loss.backward()
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    trl_grads = _lora_grads(model)

    loss, metrics = _ours(model, layout, ours_loss)
    loss.backward()
    assert 0 < metrics["rewards/accuracies"] < 1 or case == "ipo"  # a batch that tells the pairs apart
    _compare(
        trl_loss, trl_metrics, trl_grads, loss, metrics, _lora_grads(model), REWARD_METRICS + LOGPS_METRICS
    )


class _LogProbs(torch.nn.Module):
    """A model whose fused lm_head output (TRL's ``FusedCausalLMOutput`` fields that
    ``DPOTrainer._compute_loss`` reads) is given per-token log-probabilities, ``(2P, T - 1)``."""

    is_gradient_checkpointing = False

    def __init__(self, log_probs: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = log_probs

    def forward(self, input_ids, labels, **kwargs):
        from types import SimpleNamespace

        shape = self.log_probs.shape
        zeros = torch.zeros(shape)
        return SimpleNamespace(
            log_probs=self.log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(), aux_loss=None
        )


def _random_pairs(pairs: int = 5, length: int = 14, seed: int = 0):
    """``[chosen rows; rejected rows]`` ids and answer masks of varied lengths (chosen longer in some
    pairs, shorter in others), policy log-probabilities (a leaf) and a reference's near them."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 5, (2 * pairs,), generator=gen)
    answer = torch.randint(1, length - 5, (2 * pairs,), generator=gen)
    position = torch.arange(length)
    completion_mask = ((position >= prompt[:, None]) & (position < (prompt + answer)[:, None])).long()
    input_ids = torch.randint(0, 100, (2 * pairs, length), generator=gen)
    scored = completion_mask[:, 1:].bool()
    policy = (-3 * torch.rand(2 * pairs, length - 1, generator=gen)).masked_fill(~scored, 0.0)
    reference = (
        (policy + 0.4 * torch.randn(policy.shape, generator=gen)).clamp(max=-0.01).masked_fill(~scored, 0.0)
    )
    return input_ids, completion_mask, policy.requires_grad_(), reference


@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_loss_types_match_trl_on_log_probabilities(case, dpo_trainer):
    """Every DPO case on random per-token log-probabilities: TRL's ``_compute_loss`` (its model and
    reference give them) against ours from the same values (loss, metrics, gradient to each token's
    log-probability), fp32."""
    trl_config, ours_loss = DPO_CASES[case]
    trainer, defaults = dpo_trainer
    _configure(trainer, defaults, **trl_config)
    input_ids, completion_mask, policy, reference = _random_pairs()
    inputs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "completion_mask": completion_mask,
    }
    if trainer.precompute_ref_logps:  # reference-free: a reference of zeros
        inputs["ref_chosen_logps"] = inputs["ref_rejected_logps"] = torch.zeros(len(input_ids) // 2)
    model, ref_model = trainer.model, trainer.ref_model
    trainer.model, trainer.ref_model = _LogProbs(policy), _LogProbs(reference)
    try:
        trl_loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    finally:
        trainer.model, trainer.ref_model = model, ref_model
    trl_loss.backward()
    trl_grad, policy.grad = policy.grad, None
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    labels = input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)[:, 1:]
    scored = labels != IGNORE_INDEX
    ours = PairLogps.from_tokens(policy[scored], labels, ours_loss.ld_alpha)
    theirs = PairLogps.from_tokens(reference[scored], labels, ours_loss.ld_alpha)
    loss, per_pair = ours_loss(ours, None if ours_loss.reference_free else theirs)
    loss.backward()
    metrics = mean_metrics(per_pair)
    assert 0 < metrics["rewards/accuracies"] < 1 or ours_loss.reference_free  # chosen answers: longer
    assert policy.grad[scored].abs().max() > 0 and not policy.grad[~scored].any()
    # TRL sums whole rows, so its unscored positions (a model's zeros there) get the gradient too
    trl_grad = trl_grad[scored]
    _compare(
        trl_loss,
        trl_metrics,
        {"log_probs": trl_grad},
        loss,
        metrics,
        {"log_probs": policy.grad[scored]},
        REWARD_METRICS + LOGPS_METRICS,
    )


def _experimental_trainer(kind: str, model, tokenizer, tmp_path, *, dataset=None, peft_config=None, **config):
    """TRL's ``CPOTrainer`` (``kind="cpo"``) or ``ORPOTrainer``, as :func:`_dpo_trainer`."""
    if kind == "cpo":
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    args = Config(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_length=128, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            model=_load(model),
            args=args,
            train_dataset=dataset if dataset is not None else _trl_dataset(),
            processing_class=tokenizer,
            peft_config=peft_config or _lora_config(),
        )
    trainer.model.train()
    return trainer


EXPERIMENTAL_CASES = {
    "simpo": (
        "cpo",
        dict(loss_type="simpo", beta=2.0, simpo_gamma=0.6, cpo_alpha=0.0),
        PreferenceLoss("simpo", beta=2.0, gamma=0.6),
    ),
    "simpo-smoothed-nll": (
        "cpo",
        dict(loss_type="simpo", beta=2.0, simpo_gamma=0.6, label_smoothing=0.2, cpo_alpha=0.4),
        PreferenceLoss("simpo", beta=2.0, gamma=0.6, label_smoothing=0.2, rpo_alpha=0.4),
    ),
    # CPO's sigmoid is DPO with a zero reference: conservative DPO's label smoothing, as TRL writes it
    "cdpo": (
        "cpo",
        dict(loss_type="sigmoid", beta=0.1, label_smoothing=0.25, cpo_alpha=0.0),
        PreferenceLoss("dpo", beta=0.1, label_smoothing=0.25),
    ),
    "orpo": ("orpo", dict(beta=0.3), PreferenceLoss("orpo", beta=0.3)),
}


@pytest.mark.parametrize("case", EXPERIMENTAL_CASES)
def test_matches_trl_cpo_and_orpo_trainers(case, tiny_model_dir, tokenizer, pair_ids, tmp_path):
    kind, trl_config, ours_loss = EXPERIMENTAL_CASES[case]
    trainer = _experimental_trainer(kind, tiny_model_dir, tokenizer, tmp_path, **trl_config)
    model = trainer.model
    _perturb_lora(model)
    layout = _layout(pair_ids, tokenizer.pad_token_id)

    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(model, _pair_batch(layout))
    trl_loss.backward()
    trl_grads = _lora_grads(model)

    if case == "cdpo":  # a zero reference: the policy's own log-probs, minus nothing
        policy = _sequence_logps(model, layout, layout["labels"])
        zero = PairLogps(
            *(torch.zeros_like(t) for t in (policy.chosen, policy.rejected)),
            policy.chosen_tokens,
            policy.rejected_tokens,
        )
        loss, per_pair = ours_loss(policy, zero)
        metrics = mean_metrics(per_pair)
    else:
        loss, metrics = _ours(model, layout, ours_loss, orpo_sequence_nll=kind == "orpo")
    loss.backward()
    names = REWARD_METRICS + LOGPS_METRICS
    if kind == "orpo":
        names += ("log_odds_ratio", "log_odds_chosen", "nll_loss")
    if ours_loss.rpo_alpha:
        names += ("nll_loss",)
    _compare(trl_loss, trl_metrics, trl_grads, loss, metrics, _lora_grads(model), names)


# ---------------------------------------------------------------------------- step 0


def test_first_step_is_ln2_with_zero_rewards(tiny_model_dir, pair_ids, tokenizer):
    """Fresh LoRA (B = 0) against the same model with the adapter off: exactly ln 2 and 0 rewards."""
    from peft import get_peft_model

    model = get_peft_model(_load(tiny_model_dir), _lora_config())
    layout = _layout(pair_ids, tokenizer.pad_token_id)
    loss, metrics = _ours(model, layout, PreferenceLoss("dpo", beta=0.1))
    assert loss.item() == pytest.approx(math.log(2), rel=1e-7)
    assert metrics["rewards/chosen"] == metrics["rewards/rejected"] == metrics["rewards/margins"] == 0.0
    assert metrics["rewards/accuracies"] == 0.0
    _perturb_lora(model)  # the property can fail: a trained adapter moves both
    loss, metrics = _ours(model, layout, PreferenceLoss("dpo", beta=0.1))
    assert metrics["rewards/chosen"] != 0.0 and loss.item() != pytest.approx(math.log(2))


@pytest.mark.parametrize(
    "settings, setting, says",
    [
        (dict(loss_type="kto"), "loss_type", "'kto' is none of sigmoid, hinge"),
        (dict(loss_type="hinj"), "loss_type", "(closest: hinge)"),
        (dict(loss_type=[]), "loss_type", "at least one"),
        (
            dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]),
            "loss_weights",
            "1 weights for 2 loss types",
        ),
        (dict(loss_weights=[-1.0]), "loss_weights", ">= 0"),
        (dict(kind="ipo", loss_type="hinge"), "loss_type", "hinge applies to kind: dpo, not kind: ipo"),
        (dict(kind="simpo", loss_weights=[1.0]), "loss_weights", "applies to kind: dpo, not kind: simpo"),
        (dict(kind="orpo", ld_alpha=0.5), "ld_alpha", "not kind: orpo"),
        (dict(kind="simpo", reference_free=True), "reference_free", "not kind: simpo"),
        (dict(ld_alpha=1.5), "ld_alpha", "[0, 1]"),
        (dict(loss_type="exo_pair"), "label_smoothing", "must be > 0 with loss_type exo_pair"),
        (dict(loss_type="hinge", label_smoothing=0.1), "label_smoothing", "not loss_type: hinge"),
        (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing", "[0, 0.5)"),
        (dict(loss_type="bco_pair", f_divergence_type="forward_kl"), "f_divergence_type", "bco_pair"),
        (dict(f_divergence_type="kl"), "f_divergence_type", "none of reverse_kl"),
        (dict(loss_type="discopop", discopop_tau=0.0), "discopop_tau", "> 0"),
    ],
)
def test_dpo_settings_refused_naming_the_setting(settings, setting, says):
    with pytest.raises(ValueError) as error:
        PreferenceLoss(**settings)
    assert error.value.setting == setting and says in error.value.message, error.value
    from lit_instruct.errors import ConfigError

    with pytest.raises(ConfigError, match=f"model.preference.{setting}"):
        PreferenceConfig(**settings).loss()  # what `lit-instruct check` runs before any weight


def test_reference_free_has_no_reference_to_precompute():
    from lit_instruct.errors import ConfigError

    assert not PreferenceLoss(reference_free=True).needs_reference
    with pytest.raises(ConfigError, match="precompute_reference: has no reference"):
        PreferenceConfig(reference_free=True, precompute_reference=True).loss()


def test_refusals():
    with pytest.raises(ValueError, match="needs reference"):
        logps = torch.tensor([-1.0, -2.0])
        PreferenceLoss("dpo")(PairLogps(logps, logps, torch.ones(2), torch.ones(2)))
    with pytest.raises(ValueError, match="label_smoothing"):
        PreferenceLoss("ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="kind"):
        PreferenceLoss("kto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        answer_logps(torch.zeros(1, 2, 4), torch.zeros(5, 4), torch.tensor([[1, 7]]))


@pytest.mark.parametrize(
    "settings",
    [
        {"kind": "dpo"},
        {"kind": "dpo", "rpo_alpha": 0.5},
        {"kind": "dpo", "loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        {"kind": "ipo"},
        {"kind": "simpo"},
        {"kind": "simpo", "rpo_alpha": 1.0},
        {"kind": "orpo"},
    ],
    ids=lambda s: "-".join(f"{v}" for v in s.values()),
)
def test_the_declared_metric_names_are_what_a_call_returns(settings: dict) -> None:
    loss = PreferenceLoss(**settings)
    tokens = torch.tensor([3.0, 5.0])
    policy = PairLogps(torch.tensor([-4.0, -6.0]), torch.tensor([-5.0, -7.0]), tokens, tokens)
    reference = PairLogps(torch.tensor([-4.5, -6.5]), torch.tensor([-4.8, -6.9]), tokens, tokens)
    _, metrics = loss(policy, reference if loss.needs_reference else None)
    assert tuple(metrics) == loss.metric_names
