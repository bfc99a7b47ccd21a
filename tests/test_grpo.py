"""GRPO and RLOO one step (lit_instruct.objectives.online) against TRL 1.16's own ``GRPOTrainer`` and
``RLOOTrainer``: the same prompts (read and rendered by our ``InstructDataModule(batch_kind="prompts")``,
equal to TRL's own tokenization of them), the same completions (injected on both sides: our sampler
and TRL's ``_generate`` give them), the same reward functions and LoRA weights; TRL's own scoring,
advantages and loss then give the loss, its metrics and every LoRA gradient we give (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.errors import ConfigError
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.objectives import GRPO, RLOO
from lit_instruct.objectives.sampler import Completion
from lit_instruct.rewards import FormatReward, exact_answer
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import trl_online_trainer
from tests.test_preference_loss import _lora_grads

RECORDS = [
    {"prompt": "What is 12 + 7? Answer with a number.", "answer": "19"},
    {"prompt": [{"role": "user", "content": "What is 3 times 4?"}], "answer": "12"},
]
ANSWERS = [  # two per prompt: the first group's rewards differ, so do the second's
    ["It is 19.", "I think it is 20, or maybe 21"],
    ["\\boxed{12}", "Twelve, which is 3 x 4 = 12."],
]
LORA = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
BOXED = FormatReward(r"\\boxed\{")
TRL_METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "rewards/exact_answer/mean",
    "rewards/format/mean",
)


class FixedSampler:
    """Gives the completions of :data:`ANSWERS` (what TRL's injected ``_generate`` gives too)."""

    def __init__(self, completions: list[list[int]]) -> None:
        self.completions = completions

    def sample(self, model, prompt_ids, num_generations, seed):
        assert len(prompt_ids) * num_generations == len(self.completions)
        return [Completion(ids, ids[-1] != self.eos) for ids in self.completions]


def completion_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(a)["input_ids"] + [tokenizer.eos_token_id] for group in ANSWERS for a in group]


def prompt_batch(model: Path, tmp_path: Path) -> dict:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    data = InstructDataModule(
        batch_kind="prompts", tokenizer=str(model), train_files=[str(path)], val_fraction=0.0, batch_size=2
    )
    data.setup("fit")
    return data._collator()(list(data.pairs("train")))


def trl_trainer(kind: str, model: Path, tokenizer, tmp_path: Path, rewards, **config):
    """TRL's trainer over :data:`RECORDS` (a string prompt as one user turn), and its dataset."""
    prompts = [
        r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
        for r in RECORDS
    ]
    rows = [{"prompt": p, "answer": r["answer"]} for p, r in zip(prompts, RECORDS, strict=True)]
    trainer = trl_online_trainer(kind, model, tokenizer, tmp_path, rewards, rows, 4, 32, **config)
    return trainer, trainer.train_dataset


def run_theirs(trainer, dataset, tokenizer, ours: dict) -> tuple[float, dict, dict]:
    completions = completion_ids(tokenizer)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]
    prompt_ids = [ids for ids in ours["prompt_ids"] for _ in range(2)]

    def generate(prompts):
        # TRL's own tokenization of the prompts is ours
        assert trainer._tokenize_prompts(prompts)[0] == prompt_ids
        conversations = [[{"role": "assistant", "content": t}] for t in texts]
        if hasattr(trainer, "loss_type"):  # GRPOTrainer's generation gives more
            return prompt_ids, completions, None, conversations, None, {}, None, None
        return prompt_ids, completions, conversations

    trainer._generate = generate
    inputs = [dataset[i] for i in range(len(dataset)) for _ in range(2)]
    trainer._metrics["train"].clear()
    scored = trainer._generate_and_score_completions(inputs)
    loss = trainer._compute_loss(trainer.model, scored)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.item(), metrics, _lora_grads(trainer.model)


def run_ours(objective, theirs, model: Path, tokenizer, batch: dict) -> tuple[float, dict, dict]:
    sampler = FixedSampler(completion_ids(tokenizer))
    sampler.eos = tokenizer.eos_token_id
    objective.bind(tokenizer, sampler)
    module = InstructLoRAModule(model=str(model), lora=LORA, objective=objective)
    weights = {k: v for k, v in theirs.model.state_dict().items() if "lora_" in k}
    loaded = module.model.load_state_dict(weights, strict=False)
    assert not loaded.unexpected_keys and weights
    module.train()
    sums = module.objective_sums(dict(batch))
    (sums.loss_sum / sums.count).backward()
    named = dict(zip(objective.metric_names, sums.metric_sums.tolist(), strict=True))
    return (
        (sums.loss_sum / sums.count).item(),
        objective.metrics(named, sums.count),
        _lora_grads(module.model),
    )


def assert_same(ours, theirs, names) -> None:
    loss, metrics, grads = ours
    trl_loss, trl_metrics, trl_grads = theirs
    assert loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-7)
    for name in names:
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    assert trl_grads.keys() == grads.keys() and grads
    scale = max(g.abs().max() for g in trl_grads.values())
    assert scale > 0
    for name in trl_grads:
        torch.testing.assert_close(grads[name], trl_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


GRPO_CASES = {
    "dapo": {},
    "grpo-kl-batch-scaled": dict(loss_type="grpo", beta=0.04, scale_rewards="batch"),
    "dr_grpo-unscaled": dict(loss_type="dr_grpo", scale_rewards="none"),
}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_one_grpo_step_equals_trls(case, tiny_model_dir, tokenizer, tmp_path) -> None:
    config = GRPO_CASES[case]
    rewards = [exact_answer, BOXED]
    theirs, dataset = trl_trainer("grpo", tiny_model_dir, tokenizer, tmp_path, rewards, **config)
    batch = prompt_batch(tiny_model_dir, tmp_path)
    trl = run_theirs(theirs, dataset, tokenizer, batch)
    objective = GRPO(
        rewards=[{"function": "lit_instruct.rewards:exact_answer"}, BOXED],
        num_generations=2,
        max_completion_length=32,
        **config,
    )
    ours = run_ours(objective, theirs, tiny_model_dir, tokenizer, batch)
    names = TRL_METRICS + (("kl",) if config.get("beta") else ())
    assert trl[1]["reward_std"] > 0 and trl[1]["frac_reward_zero_std"] == 0  # both groups teach
    assert_same(ours, trl, names)
    # what TRL logs in the generation it was given ours in place of: by hand
    lengths = [len(ids) for ids in completion_ids(tokenizer)]
    assert ours[1]["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert ours[1]["completions/clipped_ratio"] == 0.0


def test_one_rloo_step_equals_trls(tiny_model_dir, tokenizer, tmp_path) -> None:
    rewards = [exact_answer, BOXED]
    theirs, dataset = trl_trainer("rloo", tiny_model_dir, tokenizer, tmp_path, rewards, beta=0.05)
    batch = prompt_batch(tiny_model_dir, tmp_path)
    trl = run_theirs(theirs, dataset, tokenizer, batch)
    objective = RLOO(rewards=[exact_answer, BOXED], num_generations=2, max_completion_length=32, beta=0.05)
    ours = run_ours(objective, theirs, tiny_model_dir, tokenizer, batch)
    assert_same(ours, trl, ("reward", "entropy", "kl"))


SMOLLM2_CASES = {
    "gspo-kl": ("grpo", dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)),
    "rloo-kl": ("rloo", dict(beta=0.05)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SMOLLM2_CASES))
def test_one_step_on_smollm2_equals_trls(case, smollm2_path, tokenizer, tmp_path) -> None:
    """The real SmolLM2-135M-Instruct (its chat template, tied lm_head, 30 layers): one whole step of
    TRL's trainer and ours on the same prompts and completions, fp32."""
    kind, config = SMOLLM2_CASES[case]
    rewards = [exact_answer, BOXED]
    theirs, dataset = trl_trainer(kind, smollm2_path, tokenizer, tmp_path, rewards, **config)
    batch = prompt_batch(smollm2_path, tmp_path)
    trl = run_theirs(theirs, dataset, tokenizer, batch)
    objective_class = GRPO if kind == "grpo" else RLOO
    objective = objective_class(rewards=rewards, num_generations=2, max_completion_length=32, **config)
    ours = run_ours(objective, theirs, smollm2_path, tokenizer, batch)
    names = ("reward", "reward_std", "entropy") + (("kl",) if config.get("beta") else ())
    assert_same(ours, trl, names)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(num_generations=1), r"num_generations: must be 2 or more"),
        (dict(num_iterations=0), r"num_iterations: must be 1 or more"),
        (dict(loss_type="dapo", importance_sampling_level="sequence"), r"GSPO\) takes loss_type: grpo"),
        (dict(rewards=None), r"rewards: needs at least one reward"),
        (dict(rewards=["exact_anwser"]), r"rewards\[0\]: 'exact_anwser' names no reward"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(settings, message) -> None:
    given = {"rewards": ["exact_answer"], **settings}
    with pytest.raises(ConfigError, match=rf"^model\.objective\.init_args.*{message}"):
        GRPO(**given)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Qwen3-MoE with SmolLM2's vocabulary and tokenizer, its router loss on
    (``output_router_logits``: the model's own forward adds it, and so do we; TRL's GRPOTrainer adds it
    whenever the config has the setting, even off)."""
    from transformers import AutoConfig

    from tests.families import build_family

    path = build_family("qwen3_moe", len(tokenizer), tmp_path_factory.mktemp("moe"))
    config = AutoConfig.from_pretrained(path)
    config.output_router_logits = True
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_one_grpo_step_on_a_tiny_moe_equals_trls(moe_model_dir, tokenizer, tmp_path) -> None:
    rewards = [exact_answer, BOXED]
    theirs, dataset = trl_trainer("grpo", moe_model_dir, tokenizer, tmp_path, rewards, beta=0.04)
    batch = prompt_batch(moe_model_dir, tmp_path)
    trl = run_theirs(theirs, dataset, tokenizer, batch)
    objective = GRPO(rewards=[exact_answer, BOXED], num_generations=2, max_completion_length=32, beta=0.04)
    ours = run_ours(objective, theirs, moe_model_dir, tokenizer, batch)
    assert_same(ours, trl, (*TRL_METRICS, "kl"))
    assert trl[1]["aux_loss"] > 0  # the router loss is in both losses


class PromptKeyedSampler:
    """Each prompt's completions of :data:`ANSWERS` whatever the batch's order; records the order."""

    def __init__(self, groups: dict[tuple[int, ...], list[list[int]]], eos: int) -> None:
        self.groups, self.eos, self.prompts = groups, eos, []

    def sample(self, model, prompt_ids, num_generations, seed):
        self.prompts.append([tuple(p) for p in prompt_ids])
        ids = [c for p in prompt_ids for c in self.groups[tuple(p)]]
        return [Completion(c, c[-1] != self.eos) for c in ids]


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_two_iterations_of_one_rollout_equal_trls(kind, tiny_model_dir, tokenizer, tmp_path) -> None:
    """``num_iterations: 2`` in a real fit: the data gives the window of prompts twice, the rollout
    sampled at step 1 (its old log-probs and reference log-probs taken then) trains steps 1 and 2;
    the second step's ratio to the old policy is no longer 1, so it clips. Both steps' loss and
    metrics and the LoRA weights after each AdamW step equal TRL's GRPOTrainer (RLOOTrainer) run for 2
    iterations of ``_compute_loss`` on its one scored generation (fp32)."""
    from tests.helpers import trainer
    from tests.preference_ddp_fit import StepRecorder

    lr, config = 0.05, dict(num_iterations=2, beta=0.04 if kind == "grpo" else 0.05)
    rewards = [exact_answer, BOXED]
    theirs, dataset = trl_trainer(kind, tiny_model_dir, tokenizer, tmp_path, rewards, **config)
    batch = prompt_batch(tiny_model_dir, tmp_path)
    completions = completion_ids(tokenizer)
    groups = {tuple(p): completions[2 * k : 2 * k + 2] for k, p in enumerate(batch["prompt_ids"])}
    sampler = PromptKeyedSampler(groups, tokenizer.eos_token_id)
    objective_class = GRPO if kind == "grpo" else RLOO
    objective = objective_class(rewards=rewards, num_generations=2, max_completion_length=32, **config)
    objective.bind(tokenizer, sampler)
    module = InstructLoRAModule(
        model=str(tiny_model_dir),
        lora=LORA,
        objective=objective,
        learning_rate=lr,
        warmup_steps=0,
        min_lr_ratio=1.0,
    )
    weights = {k: v for k, v in theirs.model.state_dict().items() if "lora_" in k}
    assert not module.model.load_state_dict(weights, strict=False).unexpected_keys
    data = InstructDataModule(
        batch_kind="prompts",
        tokenizer=str(tiny_model_dir),
        train_files=[str(tmp_path / "prompts.jsonl")],
        val_fraction=0.0,
        batch_size=2,
    )
    recorder = StepRecorder()
    fitted = trainer(tmp_path / "ours", max_steps=2, limit_val_batches=0, callbacks=[recorder])
    fitted.fit(module, datamodule=data)
    assert len(sampler.prompts) == 1  # sampled once, trained twice

    # TRL: its generation (ours injected, in the order our data gave the prompts), then two steps
    order = sampler.prompts[0]
    ids_of = {tuple(p): k for k, p in enumerate(batch["prompt_ids"])}
    texts = [tokenizer.decode(c, skip_special_tokens=True) for p in order for c in groups[p]]

    def generate(prompts):
        assert [tuple(p) for p in trainer_prompt_ids(prompts)[::2]] == order
        conversations = [[{"role": "assistant", "content": t}] for t in texts]
        prompt_ids = [list(p) for p in order for _ in range(2)]
        sampled = [c for p in order for c in groups[p]]
        if kind == "rloo":
            return prompt_ids, sampled, conversations
        return prompt_ids, sampled, None, conversations, None, {}, None, None

    def trainer_prompt_ids(prompts):
        return theirs._tokenize_prompts(prompts)[0]

    theirs._generate = generate
    inputs = [dataset[ids_of[p]] for p in order for _ in range(2)]
    scored = theirs._generate_and_score_completions(inputs)
    old = scored["old_per_token_logps" if kind == "grpo" else "old_logps"]
    assert old is not None  # num_iterations > 1: kept from the generation
    trained = [p for p in theirs.model.parameters() if p.requires_grad]
    betas = module.hparams["betas"]
    optimizer = torch.optim.AdamW(trained, lr=lr, betas=betas, weight_decay=0.0, foreach=True)
    for step in range(2):
        theirs._metrics["train"].clear()
        loss = theirs._compute_loss(theirs.model, scored)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        metrics = {name: values[-1] for name, values in theirs._metrics["train"].items()}
        ours = recorder.steps[step]
        assert ours["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), step
        names = ("kl", "entropy", *(f"clip_ratio/{part}_mean" for part in ("region", "low", "high")))
        for name in (n for n in names if n in metrics):  # RLOO logs its kl at the generation only
            assert ours[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-6), (step, name)
        if step == 1:
            assert metrics["clip_ratio/region_mean"] > 0  # the old policy's log-probs matter
        mine = {k.removeprefix("model."): v for k, v in recorder.weights[step].items()}
        for name, value in theirs.model.named_parameters():
            if value.requires_grad:
                torch.testing.assert_close(mine[name], value.detach(), rtol=1e-4, atol=1e-6, msg=name)
