"""Images in conversations: records that name images, masks through each family's own processor,
and one step's loss and LoRA gradients against the model's own ``forward(labels=...)``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from lit_instruct.data.collate import PackCollator
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.records import DataError
from lit_instruct.data.render import ChatRenderer
from lit_instruct.data.sources import read_source
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.models.lora_targets import is_projector
from lit_instruct.train.module import InstructLoRAModule
from tests.vision_families import (
    NO_LINEAR_PROJECTOR,
    VISION_FAMILIES,
    build_vision_family,
    chatml_with_images,
    write_images,
)

ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def user_with_image(image: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


ROWS = [
    {
        "messages": [
            user_with_image("images/red.png", "What colour is this?"),
            {"role": "assistant", "content": "Red."},
        ]
    },
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]},
    {
        "images": ["images/blue.png", "images/green.png"],
        "messages": [
            {"role": "user", "content": "<image> and <image>: which is bigger?"},
            {"role": "assistant", "content": "The green one."},
        ],
    },
    {
        "image": "images/green.png",
        "conversations": [
            {"from": "human", "value": "<image>\nName the colour."},
            {"from": "gpt", "value": "Green."},
            {"from": "human", "value": "Sure?"},
            {"from": "gpt", "value": "Yes."},
        ],
    },
]
ANSWERS = [["Red."], ["Hi!"], ["The green one."], ["Green.", "Yes."]]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vision-data")
    write_images(folder / "images")
    return write_jsonl(folder / "train.jsonl", ROWS)


def test_each_record_shape_places_its_images_where_its_text_says(data_file: Path) -> None:
    records = read_source(data_file)
    first, _, two, sharegpt = records
    assert first.messages[0].images == (str(data_file.parent / "images" / "red.png"),)
    assert first.messages[0].image_slots == (0,) and first.messages[0].content == "What colour is this?"
    assert [Path(i).name for i in two.messages[0].images] == ["blue.png", "green.png"]
    assert two.messages[0].image_slots == (0, 5) and two.messages[0].content == " and : which is bigger?"
    assert two.messages[0].for_template()["content"] == [
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image"},
        {"type": "text", "text": ": which is bigger?"},
    ]
    assert [Path(i).name for i in sharegpt.messages[0].images] == ["green.png"]
    assert not any(m.images for m in sharegpt.messages[1:])


def test_images_without_a_place_go_to_the_first_user_turn(data_file: Path, tmp_path: Path) -> None:
    row = {"images": [str(data_file.parent / "images" / "red.png")], "messages": ROWS[1]["messages"]}
    (record,) = read_source(write_jsonl(tmp_path / "d.jsonl", [row]))
    assert record.messages[0].images and record.messages[0].image_slots == (0,)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [user_with_image("missing.png", "Hi"), {"role": "assistant", "content": "Yo"}]},
            "field 'messages[0].content[0]': image file '{folder}/missing.png' does not exist",
        ),
        (
            {"messages": [user_with_image("bad.png", "Hi"), {"role": "assistant", "content": "Yo"}]},
            "field 'messages[0].content[0]': '{folder}/bad.png' is not an image PIL can read",
        ),
        (
            {
                "messages": [
                    user_with_image("https://x.org/a.png", "Hi"),
                    {"role": "assistant", "content": "Yo"},
                ]
            },
            "field 'messages[0].content[0]' is a web URL",
        ),
        (
            {
                "images": ["red.png"],
                "messages": [
                    {"role": "user", "content": "<image><image>"},
                    {"role": "assistant", "content": "Yo"},
                ],
            },
            "field 'messages[0].content' shows an image but the record's 'images' has only 1",
        ),
        (
            {
                "images": ["red.png", "red.png"],
                "messages": [
                    {"role": "user", "content": "<image> hi"},
                    {"role": "assistant", "content": "Yo"},
                ],
            },
            "field 'images' lists 2 images but the turns show 1",
        ),
        (
            {"images": ["red.png"], "instruction": "Hi", "output": "Yo"},
            "field 'images': images are read in chat, ShareGPT",
        ),
    ],
    ids=["missing", "unreadable", "web-url", "too-few", "too-many", "alpaca"],
)
def test_a_bad_image_is_a_file_line_error_naming_the_field(tmp_path: Path, row: dict, message: str) -> None:
    write_images(tmp_path)
    (tmp_path / "bad.png").write_bytes(b"not a png")
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError) as error:
        read_source(path)
    assert str(error.value).startswith(f"{path}:1: " + message.format(folder=tmp_path))


def test_a_text_only_model_refuses_records_with_images(data_file: Path, tokenizer) -> None:
    record = read_source(data_file)[0]
    with pytest.raises(DataError, match=r"train\.jsonl:1: messages\[0\] shows an image but the model has no"):
        ChatRenderer(tokenizer, 64).samples(record)


@pytest.fixture(scope="module", params=sorted(VISION_FAMILIES))
def family(request, tmp_path_factory, smollm2_path) -> tuple[str, Path]:
    return request.param, build_vision_family(
        request.param, smollm2_path, tmp_path_factory.mktemp(request.param)
    )


def data_module(model: Path, data_file: Path, max_seq_len: int = 256) -> InstructDataModule:
    module = InstructDataModule(
        tokenizer=str(model),
        train_files=[str(data_file)],
        max_seq_len=max_seq_len,
        batch_size=4,
        val_fraction=0.0,
        cache=False,
        deduplicate=False,
    )
    module.setup("fit")
    return module


@pytest.fixture(scope="module")
def family_data(family, data_file: Path) -> InstructDataModule:
    """The family's data module on ``ROWS``, set up once."""
    return data_module(family[1], data_file)


def test_answers_are_labelled_and_image_tokens_never(family, family_data, tokenizer) -> None:
    """Each sample's labels are its answers' tokens and end-of-turn markers, nothing else; the image
    tokens (every id the family added to SmolLM2's vocabulary) are in the samples that show images
    and never labelled."""
    name, _ = family
    data = family_data
    image_ids = set(range(len(tokenizer), len(data.processor.tokenizer)))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    samples = list(data.train_samples)
    assert [len(s.images) for s in samples] == [1, 0, 2, 1]
    json.dumps(data.counts)  # plain numbers, as the cache's meta.json holds them (Pixtral's are tensors)
    for sample, answers in zip(samples, ANSWERS, strict=True):
        labelled = [label for label in sample.labels if label != IGNORE_INDEX]
        expected = [t for a in answers for t in [*tokenizer(a, add_special_tokens=False)["input_ids"], end]]
        assert labelled == expected, name
        assert not image_ids & set(labelled)
        assert bool(image_ids & set(sample.input_ids)) == bool(sample.images)


@pytest.mark.parametrize("vision", ["none", "projector", "all"])
def test_loss_and_lora_gradients_equal_the_models_own(family, family_data, vision: str) -> None:
    """A batch mixing text-only and image samples: the module's loss and every LoRA gradient equal
    the model's own ``forward(labels=...)`` with the same masks and pixels, with the vision layers
    frozen, the projector adapted, or every linear layer adapted."""
    name, model = family
    batch = next(iter(family_data.train_dataloader()))
    assert batch["images"]["pixel_values"].shape[0] >= 1 and batch["input_ids"].shape[0] == 4
    lora = LoRAConfig(r=4, alpha=8, vision=vision)
    if vision == "projector" and name in NO_LINEAR_PROJECTOR:
        with pytest.raises(ConfigError, match=r"^model\.lora\.vision: projector, but .* has no linear layer"):
            InstructLoRAModule(model=str(model), lora=lora, loss="reference")
        return
    module = InstructLoRAModule(model=str(model), lora=lora, loss="reference")
    torch.manual_seed(1)
    with torch.no_grad():
        for param_name, p in module.named_parameters():
            if "lora_B" in param_name:
                p.normal_(0.0, 0.05)
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    own = own_loss(module, batch)
    own_grads = torch.autograd.grad(own, list(params.values()))
    sums = module.objective.sums(module, batch)
    ours = sums.loss_sum / sums.count
    our_grads = torch.autograd.grad(ours, list(params.values()))
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-6)
    for key, mine, theirs in zip(params, our_grads, own_grads, strict=True):
        scale = float(theirs.abs().max())
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * scale, msg=f"{name} {key}")
    text = decoder_name(module.base_model)
    outside = {key for key in params if text not in key}
    if vision == "none":
        assert not outside
    else:
        untrained = [
            k for k, g in zip(params, own_grads, strict=True) if k in outside and not g.count_nonzero()
        ]
        assert outside and not untrained
    if vision == "projector":
        assert all(is_projector(key) for key in outside)
    if vision == "all":  # every linear layer of the model but the head has an adapter
        unadapted = [
            n
            for n, m in module.base_model.named_modules()
            if type(m) is torch.nn.Linear and "lora_" not in n and not n.endswith("base_layer")
        ]
        assert unadapted == ["lm_head"]


def own_loss(module: InstructLoRAModule, batch: dict) -> torch.Tensor:
    """The model's own ``forward(labels=...)`` loss on ``batch``, its images included."""
    return module.model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        use_cache=False,
        **batch["images"],
    ).loss


def decoder_name(model: torch.nn.Module) -> str:
    """The name of ``model``'s language model (its decoder trunk) among its modules."""
    from lit_instruct.models.decoder import decoder_of

    decoder = decoder_of(model)
    return next(name for name, module in model.named_modules() if module is decoder)


def test_a_sample_is_cut_before_an_image_never_through_it(family, data_file: Path) -> None:
    """A cut that would fall inside an image's tokens falls before them: the image is left out of
    the sample, the tokens and labels kept are the whole sample's."""
    name, model = family
    row = {
        "images": ["images/green.png"],
        "messages": [
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "<image> Colour?"},
            {"role": "assistant", "content": "Green."},
        ],
    }
    path = write_jsonl(data_file.parent / f"cut-{name}.jsonl", [row])
    data = data_module(model, path)
    whole, image_id = data.train_samples[0], AutoConfig.from_pretrained(model).image_token_id
    inside = whole.input_ids.index(image_id) + 1
    assert whole.input_ids[inside] == image_id  # the cut below falls between two of the image's tokens
    cut = data_module(model, path, max_seq_len=inside + 1).train_samples[0]
    assert cut.images == () and len(cut.input_ids) < inside and cut.full_length == len(whole.input_ids)
    assert cut.input_ids == whole.input_ids[: len(cut.input_ids)]
    assert torch.equal(torch.tensor(cut.labels), torch.tensor(whole.labels[: len(cut.labels)]))
    assert any(label != IGNORE_INDEX for label in cut.labels)  # the first answer is kept


@pytest.fixture(scope="module")
def llava(tmp_path_factory, smollm2_path) -> Path:
    """One tiny model, for the checks that do not depend on the family."""
    return build_vision_family("llava", smollm2_path, tmp_path_factory.mktemp("llava"))


def test_an_image_inside_an_answer_is_refused(llava: Path, data_file: Path) -> None:
    """Refused from the record, before the template renders it (a special token in an answer would
    otherwise end the answer's span early)."""
    row = {
        "messages": [
            {"role": "user", "content": "Draw red."},
            {"role": "assistant", "content": [{"type": "image", "image": "images/red.png"}]},
        ]
    }
    path = write_jsonl(data_file.parent / "answer.jsonl", [row])
    with pytest.raises(DataError, match=r":1: messages\[1\]: an image is inside an answer"):
        data_module(llava, path)


def test_packing_refuses_samples_with_images(llava: Path, data_file: Path) -> None:
    """When the data is read (before any weight), and by the packing collator itself."""
    data = InstructDataModule(
        tokenizer=str(llava), train_files=[str(data_file)], val_fraction=0.0, cache=False, packing=True
    )
    with pytest.raises(ConfigError, match=r"data\.packing: true cannot pack samples with images"):
        data.setup("fit")
    streamed = InstructDataModule(
        tokenizer=str(llava), train_files=[str(data_file)], packing=True, streaming=True
    )
    with pytest.raises(
        ConfigError, match=r"data\.packing: true with data\.streaming: true cannot be checked"
    ):
        streamed.setup("fit")  # a stream is read while training: refused for the model, whatever it holds
    samples = list(data_module(llava, data_file).train_samples)
    with pytest.raises(ValueError, match=r"train\.jsonl:1: a packed row cannot carry images"):
        PackCollator()(samples)


def test_a_changed_image_rebuilds_the_cached_samples(tmp_path: Path, smollm2_path: Path) -> None:
    model = build_vision_family("idefics3", smollm2_path, tmp_path / "model")
    paths = write_images(tmp_path / "images")
    data = write_jsonl(tmp_path / "d.jsonl", ROWS[:1])

    def cached() -> InstructDataModule:
        module = InstructDataModule(
            tokenizer=str(model),
            train_files=[str(data)],
            max_seq_len=512,
            val_fraction=0.0,
            cache_dir=str(tmp_path / "cache"),
        )
        module.setup("fit")
        return module

    first = cached()
    assert not first.prepared.cached
    assert cached().prepared.cached
    from PIL import Image

    Image.new("RGB", (120, 40), (0, 0, 0)).save(paths["red"])  # wider: Idefics3 splits it otherwise
    again = cached()
    assert not again.prepared.cached
    assert len(again.train_samples[0].input_ids) != len(first.train_samples[0].input_ids)


def test_fit_trains_and_the_adapter_loads_with_peft_on_the_multimodal_class(
    tmp_path: Path, smollm2_path: Path
) -> None:
    import lightning as L
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = build_vision_family("llava", smollm2_path, tmp_path / "model")
    write_images(tmp_path / "images")
    rows = [
        {
            "messages": [
                user_with_image(f"images/{c}.png", "Colour?"),
                {"role": "assistant", "content": f"{c}."},
            ]
        }
        for c in ("red", "blue", "green")
    ]
    data = InstructDataModule(
        tokenizer=str(model),
        train_files=[str(write_jsonl(tmp_path / "d.jsonl", rows * 2))],
        max_seq_len=128,
        batch_size=2,
        val_fraction=0.0,
        deduplicate=False,
        cache=False,
    )
    module = InstructLoRAModule(
        model=str(model),
        lora=LoRAConfig(r=4, alpha=8),
        learning_rate=1e-2,
        adapter_dir=str(tmp_path / "adapter"),
    )
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert "<image>" in (tmp_path / "adapter" / "chat_template.jinja").read_text()  # the processor's template
    batch = next(iter(data.val_dataloader() if len(data.val_samples) else data.train_dataloader()))
    module.eval()
    with torch.no_grad():
        ours = module.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **batch["images"]
        ).logits
        base = AutoModelForImageTextToText.from_pretrained(model)
        loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        inputs = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            **batch["images"],
        }
        theirs = loaded(**inputs).logits
        with loaded.disable_adapter():
            untrained = loaded(**inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(theirs, untrained, atol=1e-3)


def models_own_answer(model: Path, max_new_tokens: int) -> Callable[[list[dict], list[Path]], str]:
    """The reference for ``generate --image`` and ``chat``: the model's own greedy ``generate`` on its
    processor's inputs for a conversation (image parts without their images) and its image files."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from lit_instruct.data.processor import image_processor_of

    tokenizer = AutoTokenizer.from_pretrained(model)
    processor = image_processor_of(str(model), tokenizer)  # AutoProcessor's class, less its video part
    net = AutoModelForImageTextToText.from_pretrained(model).eval()

    def answer(messages: list[dict], images: list[Path]) -> str:
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pixels = [[Image.open(image).convert("RGB") for image in images]]
        inputs = processor(text=[text], images=pixels, add_special_tokens=False, return_tensors="pt")
        out = net.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    return answer


def test_generate_answers_about_an_image_as_the_model_does(
    tmp_path: Path, smollm2_path: Path, capsys
) -> None:
    """``lit-instruct generate --image`` gives the tokens the model's own ``generate`` gives on the
    processor's inputs for the same conversation; a bad image or a text-only model is one line."""
    from lit_instruct.cli import generate_main

    model = build_vision_family("qwen2_vl", smollm2_path, tmp_path / "model")
    image = write_images(tmp_path / "images")["green"]
    generate_main(
        ["--model", str(model), "--image", str(image), "--prompt", "Colour?", "--max-new-tokens", "6"]
    )
    ours = capsys.readouterr().out.strip()
    asking = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    theirs = models_own_answer(model, max_new_tokens=6)(asking, [image]).strip()
    assert ours == theirs and ours

    for argv, message in (
        (
            ["--model", str(model), "--image", str(tmp_path / "none.png")],
            r"^--image: image file '.*none\.png' does",
        ),
        (["--model", str(smollm2_path), "--image", str(image)], r"^--image: .* takes no images"),
    ):
        with pytest.raises(ConfigError, match=message):
            generate_main([*argv, "--prompt", "Hi"])


def test_vision_adapters_a_batch_with_images_never_reaches_are_named(
    data_file: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    """LLaVA reading its image features off the vision tower's next-to-last layer computes the last
    layer for nothing: after the first batch with images, its adapters (and only they) are named."""
    from tests.helpers import make, trainer

    model = build_vision_family("llava", smollm2_path, tmp_path / "llava")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -2}))
    module, data = make(model, data_file, lora=LoRAConfig(r=4, alpha=8, vision="all"))
    with pytest.warns(UserWarning, match="model.lora.vision: 6 adapted layer") as caught:
        trainer(tmp_path / "run", max_steps=1, limit_val_batches=0).fit(module, datamodule=data)
    (message,) = [str(w.message) for w in caught if "model.lora.vision" in str(w.message)]
    last = "model.vision_tower.encoder.layers.1."  # its 6 linear layers, none of the first layer's
    assert (
        f"({last}mlp.fc1, {last}mlp.fc2, {last}self_attn.k_proj, {last}self_attn.out_proj and 2 more)"
        in message
    )


def test_chat_shows_each_image_with_its_message_as_the_model_does(
    llava: Path, data_file: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """``lit-instruct chat --image`` and ``/image``: each answer is the model's own ``generate`` on the
    processor's inputs for the whole conversation so far, earlier images included; a bad ``/image``
    is a note and the chat goes on; ``--image`` on a text-only model is one line before any weight."""
    import io
    import shutil
    import sys

    from lit_instruct.cli import chat_main

    images = data_file.parent / "images"
    typed = f"Colour?\n/image {images / 'none.png'}\n/image {images / 'blue.png'}\nAnd this?\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    chat_main(["--model", str(llava), "--image", str(images / "red.png"), "--max-new-tokens", "5"])
    printed = capsys.readouterr().out
    assert f"(/image: image file '{images / 'none.png'}' does not exist)" in printed
    assert "(1 image will be shown with your next message)" in printed

    answer = models_own_answer(llava, max_new_tokens=5)

    def asking(text: str) -> dict:
        return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}

    first = answer([asking("Colour?")], [images / "red.png"])
    second = answer(
        [asking("Colour?"), {"role": "assistant", "content": first}, asking("And this?")],
        [images / "red.png", images / "blue.png"],
    )
    assert f"> {first}\n" in printed and f"> {second}\n" in printed and first and second

    text_only = tmp_path / "text-only"
    shutil.copytree(tiny_model_dir, text_only)
    (text_only / "model.safetensors").write_bytes(b"not weights")  # never read
    with pytest.raises(ConfigError, match=r"^--image: .* takes no images"):
        chat_main(["--model", str(text_only), "--image", str(images / "red.png")])


def test_chat_leaves_out_the_oldest_exchange_with_its_image(llava: Path, data_file: Path) -> None:
    """The context budget counts each image as the tokens the processor expands it to; an exchange
    left out for room takes its image with it."""
    from transformers import AutoTokenizer

    from lit_instruct.data.processor import image_processor_of
    from lit_instruct.infer.chat import ChatSession
    from lit_instruct.infer.generate import load_for_generation, open_images
    from lit_instruct.models.generation import image_parts

    model, tokenizer = load_for_generation(str(llava))
    processor = image_processor_of(str(llava), AutoTokenizer.from_pretrained(llava))
    red, blue = open_images([str(data_file.parent / "images" / f"{c}.png") for c in ("red", "blue")])
    session = ChatSession(model, tokenizer, 10_000, max_new_tokens=2, processor=processor, images=[red])
    session.reply("Colour?")
    session.show_image(str(data_file.parent / "images" / "blue.png"))
    session.reply("And this?")
    whole = session.messages("Which?")
    assert image_parts(whole) == [red, blue] and session.pending_images == []
    text = processor.apply_chat_template(whole, tokenize=False, add_generation_prompt=True)
    expanded = processor(text=[text], images=[[red, blue]], add_special_tokens=False)["input_ids"][0]
    assert session.prompt_tokens(whole) == len(expanded) > len(tokenizer(text)["input_ids"])
    session.context_length = len(expanded) + 2 - 1  # one token short of the whole conversation
    kept = session.messages("Which?")
    assert kept == whole[2:] and image_parts(kept) == [blue]

    import io

    from lit_instruct.infer.chat import run_chat, scripted_reader

    session.show_image(str(data_file.parent / "images" / "red.png"))
    session.context_length = 8  # the waiting image alone does not fit: said, and dropped
    out = io.StringIO()
    run_chat(session, scripted_reader(["Which?\n"], out), out)
    assert "the waiting image is dropped)" in out.getvalue() and session.pending_images == []


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_qlora_keeps_the_vision_tower_in_full_precision_and_its_loss_is_the_models_own(
    name: str, data_file: Path, tmp_path: Path, smollm2_path: Path
) -> None:
    pytest.importorskip("bitsandbytes")
    from lit_instruct.models.load import QuantizationConfig

    model = build_vision_family(name, smollm2_path, tmp_path / name)
    batch = next(iter(data_module(model, data_file).train_dataloader()))
    nf4 = QuantizationConfig(method="nf4", compute_dtype="float32")
    module = InstructLoRAModule(
        model=str(model), lora=LoRAConfig(r=4, alpha=8, vision="all"), quantization=nf4
    )
    kinds = {
        (type(m).__name__, "language_model" in n)
        for n, m in module.base_model.named_modules()
        if type(m).__name__ in ("Linear", "Linear4bit") and "lora_" not in n
    }
    assert kinds == {("Linear4bit", True), ("Linear", False)}  # the decoder 4-bit, vision layers and head not
    own = own_loss(module, batch)
    sums = module.objective.sums(module, batch)
    torch.testing.assert_close(sums.loss_sum / sums.count, own, rtol=1e-5, atol=1e-6)


def test_a_merged_vision_language_model_loads_with_its_processor_and_answers_as_the_adapter(
    tmp_path: Path, smollm2_path: Path, data_file: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lit_instruct.export.adapter import merge_adapter

    model = build_vision_family("llava", smollm2_path, tmp_path / "model")
    module = InstructLoRAModule(model=str(model), lora=LoRAConfig(r=4, alpha=8, vision="projector"))
    torch.manual_seed(2)
    with torch.no_grad():
        for param_name, p in module.named_parameters():
            if "lora_B" in param_name:
                p.normal_(0.0, 0.05)
    module.write_adapter(tmp_path / "adapter")
    out = merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    batch = next(iter(data_module(model, data_file).train_dataloader()))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **batch["images"]}
    with torch.no_grad():
        merged = AutoModelForImageTextToText.from_pretrained(out).eval()(**inputs).logits
        adapted = PeftModel.from_pretrained(
            AutoModelForImageTextToText.from_pretrained(model), tmp_path / "adapter"
        )
        expected = adapted.eval()(**inputs).logits
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    assert AutoProcessor.from_pretrained(out).image_token == "<image>"


def test_gguf_export_of_a_vision_language_model_is_refused_naming_the_projector_file(family) -> None:
    from lit_instruct.export.gguf import check_supported

    _, model = family
    with pytest.raises(
        ValueError, match=r"llama\.cpp reads its vision tower and projector from a separate mmproj"
    ):
        check_supported(AutoConfig.from_pretrained(model))


@pytest.mark.e2e
def test_the_bundled_vision_model_reads_text_as_smollm2_does(smollm2_path: Path) -> None:
    """The images demo's model carries SmolLM2's weights exactly: on text, its logits are SmolLM2's
    (the ``<image>`` row aside)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from lit_instruct.model_names import resolve_model_path

    vision = AutoModelForImageTextToText.from_pretrained(resolve_model_path("smollm2-135m-vision")).eval()
    text = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    ids = AutoTokenizer.from_pretrained(smollm2_path)("The sky is blue because", return_tensors="pt")[
        "input_ids"
    ]
    with torch.no_grad():
        ours, theirs = vision(input_ids=ids).logits, text(input_ids=ids).logits
    torch.testing.assert_close(ours[..., : theirs.shape[-1]], theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_vlm_config_trains_and_its_held_out_loss_falls(smollm2_path, tmp_path, monkeypatch) -> None:
    """``lit-instruct fit --config configs/vlm.yaml`` (6 steps) on the shipped shapes."""
    import csv

    from lit_instruct.cli import main

    monkeypatch.chdir(ROOT)  # the config names its data relative to the repository
    csv_logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path), "name": ""},
    }
    args = ["fit", "--config", "configs/vlm.yaml", "--trainer.logger", json.dumps(csv_logger)]
    args += ["--trainer.max_steps", "6", "--trainer.val_check_interval", "6"]
    args += ["--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks", "null"]
    args += ["--trainer.enable_progress_bar", "false", "--model.adapter_dir", str(tmp_path / "adapter")]
    main(args)
    with open(tmp_path / "version_0" / "metrics.csv", encoding="utf-8") as rows:
        validated = [float(row["val/loss"]) for row in csv.DictReader(rows) if row.get("val/loss")]
    assert validated[-1] < 0.5 * validated[0]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_sample_scores_leave_out_held_out_samples_with_images(tokenizer) -> None:
    """SampleScores answers from token ids: a sample with images would be answered without them."""
    from callbacks.sample_scores import held_out_conversations
    from lit_instruct.data.render import Sample

    ids = tokenizer("Question? Answer.", add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * 2 + ids[2:]
    samples = [Sample(ids, labels, "a.jsonl:1", images=("red.png",)), Sample(ids, labels, "a.jsonl:2")]
    assert [item.origin for item in held_out_conversations(samples, tokenizer, 4)] == ["a.jsonl:2"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_lora", "fsdp_lora"])
def test_two_ranks_with_images_train_as_one_process(
    strategy: str, llava: Path, data_file: Path, tmp_path: Path
) -> None:
    """5 conversations (images in 4, two in one of them) on 2 ranks of batch 1, the vision tower and
    projector adapted too, gradients clipped: 3 steps equal one process of batch 2, a rank whose
    sample has no image included (its vision adapters unused there: DDP must look for unused
    weights; FSDP keeps the vision tower whole and averages its gradients), and the third step's
    repeat (images and all) counting no token. The losses are equal; the weights to 1% of one step
    (lr 1e-2): Adam divides each gradient component by its own size, so a component near zero,
    summed in another order over ranks, moves its weight by more than its rounding (2.4e-5 measured
    here; a wrong image or mask moves whole steps)."""
    from tests.ddp_fit import run_ddp_fit
    from tests.helpers import Recorder, make, trainer

    blue = {
        "messages": [
            user_with_image("images/blue.png", "And this?"),
            {"role": "assistant", "content": "Blue."},
        ]
    }
    five = write_jsonl(data_file.parent / "five.jsonl", [*ROWS, blue])
    args = {"model": str(llava), "data": str(five), "out": str(tmp_path / "two"), "batch_size": 1}
    clip = {"gradient_clip_val": 0.05}
    ranks = run_ddp_fit({**args, "max_steps": 3, "strategy": strategy, "lora_vision": "all", **clip})
    module, _ = make(llava, five, lora=LoRAConfig(r=4, alpha=8, vision="all"))
    data = InstructDataModule(tokenizer=str(llava), train_files=[str(five)], batch_size=2)  # as ddp_fit's
    recorder = Recorder()
    run = trainer(tmp_path / "one", max_steps=3, limit_val_batches=0, callbacks=[recorder], **clip)
    run.fit(module, datamodule=data)
    assert len(data.train_samples) == 5
    image_token = module.base_model.config.image_token_id
    shows = [[image_token in ids for _, ids in rank["samples"]] for rank in ranks]
    steps = {tuple(step) for step in zip(*shows, strict=False)}  # the last step's repeat counts nothing
    assert {(False, True), (True, False)} & steps  # a step on which one rank's tower is unused
    vision = [name for name in module.trainable_state_dict() if "vision_tower" in name]
    assert vision  # the tower's adapters are among the weights compared
    for rank in ranks:
        torch.testing.assert_close(
            torch.tensor(rank["losses"]), torch.tensor(recorder.losses), rtol=1e-6, atol=0
        )
    checkpoint = torch.load(tmp_path / "two" / "last.ckpt", weights_only=True)
    saved = checkpoint["state_dict"]  # whole, on rank 0
    assert len(checkpoint["optimizer_states"][0]["param_groups"]) == 1  # as one process's: it resumes there
    adapter = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    single = module.trainable_state_dict()
    assert saved.keys() == single.keys() and len(adapter) == len(single)
    for name, value in single.items():
        torch.testing.assert_close(saved[name], value, atol=1e-4, rtol=0, msg=name)
        peft_name = name.removeprefix("model.").replace(".default.", ".")
        torch.testing.assert_close(adapter[peft_name], value, atol=1e-4, rtol=0, msg=name)
    resumed, _ = make(llava, five, lora=LoRAConfig(r=4, alpha=8, vision="all"))
    again = trainer(tmp_path / "resumed", max_steps=4, limit_val_batches=0, **clip)
    data = InstructDataModule(tokenizer=str(llava), train_files=[str(five)], batch_size=2)
    again.fit(resumed, datamodule=data, ckpt_path=tmp_path / "two" / "last.ckpt")
    assert again.global_step == 4


def test_a_missing_image_is_one_line_and_exit_2_before_any_weight(
    llava: Path, tmp_path: Path, capsys
) -> None:
    """``lit-instruct fit`` on data naming an image that is not there: exit 2, one line with the
    file, line and field, and the model's weights never read (they are unreadable here)."""
    import shutil

    from lit_instruct.cli import main

    model = tmp_path / "unreadable"
    shutil.copytree(llava, model)
    (model / "model.safetensors").write_bytes(b"not weights")
    rows = [{"messages": [user_with_image("gone.png", "Colour?"), {"role": "assistant", "content": "Red."}]}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    args = ["fit", "--config", str(ROOT / "configs" / "vlm.yaml"), "--model.model", str(model)]
    with pytest.raises(SystemExit) as exited:
        main([*args, "--data.train_files", f"[{data}]", "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert exited.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-instruct: data")]
    assert lines == [
        f"lit-instruct: data error: {data}:1: field 'messages[0].content[0]': image file "
        f"'{tmp_path / 'gone.png'}' does not exist"
    ]


def test_a_template_that_drops_an_earlier_image_is_refused(llava: Path, data_file: Path) -> None:
    """Images are matched to their placeholders in order: a template that shows only the last turn's
    images would give the first image the second's place, so it is refused."""
    last_only = chatml_with_images("<image>").replace(
        "part['type'] == 'image' %}<image>", "part['type'] == 'image' and loop.last %}<image>"
    )
    last_only = last_only.replace(
        "{% for message in messages %}", "{% for message in messages %}{% set outer = loop %}"
    )
    last_only = last_only.replace("and loop.last %}", "and outer.index >= messages|length - 1 %}")
    row = {
        "messages": [
            user_with_image("images/red.png", "This?"),
            {"role": "assistant", "content": "Red."},
            user_with_image("images/blue.png", "And this?"),
            {"role": "assistant", "content": "Blue."},
        ]
    }
    path = write_jsonl(data_file.parent / "two-images.jsonl", [row])
    data = InstructDataModule(
        tokenizer=str(llava), train_files=[str(path)], val_fraction=0.0, cache=False, chat_template=last_only
    )
    with pytest.raises(DataError, match=r"two-images\.jsonl:1: the chat template shows 1 image placeholders"):
        data.setup("fit")


def test_turns_kept_as_json_text_show_their_images(data_file: Path, tmp_path: Path) -> None:
    """A table keeps a record's messages as JSON text: its images are read all the same."""
    turns = [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "Red."}]
    row = {"images": [str(data_file.parent / "images" / "red.png")], "messages": json.dumps(turns)}
    (record,) = read_source(write_jsonl(tmp_path / "d.jsonl", [row]))
    assert [Path(i).name for i in record.messages[0].images] == ["red.png"] and not record.unused


def test_online_rl_prompts_with_images_are_refused(data_file: Path) -> None:
    from lit_instruct.data.prompts import to_prompt_record

    raw = {
        "prompt": [user_with_image(str(data_file.parent / "images" / "red.png"), "Colour?")],
        "answer": "red",
    }
    with pytest.raises(DataError, match=r"p:1: messages\[0\] shows an image: online RL samples from text"):
        to_prompt_record(raw, "p:1")


def test_train_on_all_trains_every_token_but_the_images(llava: Path, data_file: Path, tokenizer) -> None:
    data = InstructDataModule(
        tokenizer=str(llava), train_files=[str(data_file)], val_fraction=0.0, cache=False, train_on="all"
    )
    data.setup("fit")
    image_ids = set(range(len(tokenizer), len(data.processor.tokenizer)))
    for sample in data.train_samples:
        for token, label in zip(sample.input_ids, sample.labels, strict=True):
            assert label == (IGNORE_INDEX if token in image_ids else token)


def test_an_image_the_processor_refuses_is_a_file_line_error(tmp_path: Path, smollm2_path: Path) -> None:
    """PIL reads it, Qwen-VL's processor does not (an aspect ratio over 200): a data error, skipped
    and counted under on_bad_record: skip like any bad record."""
    from PIL import Image

    model = build_vision_family("qwen2_vl", smollm2_path, tmp_path / "model")
    Image.new("RGB", (600, 2), (255, 0, 0)).save(tmp_path / "thin.png")
    rows = [{"messages": [user_with_image("thin.png", "What?"), {"role": "assistant", "content": "A line."}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"d\.jsonl:1: the processor refused the images \(thin\.png\)"):
        data_module(model, path)


def test_lora_vision_with_layers_to_transform_is_refused(llava: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^model\.lora\.vision: all cannot be combined with model\.lora\.layers"
    ):
        InstructLoRAModule(model=str(llava), lora=LoRAConfig(r=4, vision="all", layers_to_transform=[0]))


def test_the_cache_key_knows_the_processors_own_settings(smollm2_path: Path, tmp_path: Path) -> None:
    """Two Idefics3 processors that differ only in image_seq_len expand images differently."""
    from transformers import AutoProcessor

    from lit_instruct.data.prepare import image_processing_key

    model = build_vision_family("idefics3", smollm2_path, tmp_path / "model")
    four, nine = AutoProcessor.from_pretrained(model), AutoProcessor.from_pretrained(model, image_seq_len=9)
    assert image_processing_key(four) != image_processing_key(nine)
