from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from cluster.tokenizer import Tokenizer
from workers.detokenizer import IncrementalDetokenizer, update_all

CORPUS = [
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "The end of the story is near, said the fox to the dog.",
    "héllo wörld, café crème brûlée",
    "日本語 のテキスト 🙂 emoji 🚀",
    "Stop here: ### and then continue with more words.",
]
MULTIBYTE = "héllo wörld 日本語 🙂 ok"

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _write_checkpoint(model_dir: Path, chat_template: str | list[dict[str, str]] | None = LLAMA3) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    backend.save(str(model_dir / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    return model_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    tok = Tokenizer.from_pretrained(_write_checkpoint(tmp_path_factory.mktemp("ckpt")))
    assert tok is not None
    return tok


def test_tokenizer_loads_special_tokens(tokenizer: Tokenizer, tmp_path: Path) -> None:
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.eos_token_ids == (1, 4)
    assert tokenizer.vocab_size == 330
    ids = tokenizer.encode("Hello world.")
    assert ids[0] == 0 and tokenizer.encode("Hello world.", add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == "Hello world."
    assert tokenizer.decode([*ids, 1], skip_special_tokens=False) == "<s>Hello world.</s>"
    assert tokenizer.convert_ids_to_tokens([0, 1]) == ["<s>", "</s>"]
    assert Tokenizer.from_pretrained(tmp_path) is None


def test_multibyte_text_really_splits_characters(tokenizer: Tokenizer) -> None:
    # Guards the tests below: some token must end inside a multi-byte character.
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert any(tokenizer.decode(ids[: i + 1]).endswith("\ufffd") for i in range(len(ids)))


@pytest.mark.parametrize("text", [CORPUS[0], MULTIBYTE, "The fox said: 🙂🙂 ünïcödé!"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_full_decode(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    prompt_ids = tokenizer.encode("The quick brown fox says ")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])
    deltas = []
    expected = ""
    for start in range(0, len(ids), chunk):
        assert detok.update(ids[start : start + chunk]) is None
        full = tokenizer.decode(ids[: start + chunk])
        if not full.endswith("\ufffd"):  # else a character is still incomplete: the text must wait
            expected = full
        assert detok.output_text == expected
        delta = detok.get_delta(finished=False)
        assert "\ufffd" not in delta
        deltas.append(delta)
    assert detok.output_text == text
    assert detok.output_token_ids == ids
    assert "".join(deltas) + detok.get_delta(finished=True) == text


def test_batched_update_equals_one_by_one(tokenizer: Tokenizer) -> None:
    """update_all over requests in every state (mid-character, stopped, fed nothing, keeping special
    tokens, stop strings held back) leaves each detokenizer exactly as its own update() calls would."""
    prompt = tokenizer.encode("The quick brown fox says ")
    streams = [
        tokenizer.encode(MULTIBYTE, add_special_tokens=False),
        tokenizer.encode("Stop here: ### and then continue", add_special_tokens=False),
        [*tokenizer.encode("Hello world", add_special_tokens=False), 1, 1],
        tokenizer.encode(CORPUS[3], add_special_tokens=False),
        tokenizer.encode("the lazy dog. The end", add_special_tokens=False),
    ]

    def make() -> list[IncrementalDetokenizer]:
        return [
            IncrementalDetokenizer(tokenizer, prompt, stop=[]),
            IncrementalDetokenizer(tokenizer, [0], stop=["###", "and then"]),
            IncrementalDetokenizer(tokenizer, [0], stop=[], skip_special_tokens=False),
            IncrementalDetokenizer(tokenizer, prompt, stop=["never appears"]),
            IncrementalDetokenizer(tokenizer, [], stop=["end", "lazy"]),
        ]

    batched, single = make(), make()
    chunks = [1, 2, 1, 3, 4]  # tokens per update, per stream
    num_updates = max(-(-len(ids) // c) for ids, c in zip(streams, chunks, strict=True))
    assert num_updates > 5
    for u in range(num_updates):
        new = [ids[u * c : (u + 1) * c] for ids, c in zip(streams, chunks, strict=True)]  # some run dry
        got = update_all(tokenizer, batched, new)
        assert got == [d.update(ids) for d, ids in zip(single, new, strict=True)], u
        for b, d in zip(batched, single, strict=True):
            assert vars(b) == vars(d), u
            assert b.get_delta(finished=False) == d.get_delta(finished=False), u
    assert [d.stop_matched for d in batched] == [None, "###", None, None, "lazy"]
    assert batched[0].output_text == MULTIBYTE and batched[2].output_text == "Hello world</s></s>"


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("Hello world", add_special_tokens=False), 1]
    skipped = IncrementalDetokenizer(tokenizer, [0], stop=[])
    kept = IncrementalDetokenizer(tokenizer, [0], stop=[], skip_special_tokens=False)
    for token_id in ids:
        skipped.update([token_id])
        kept.update([token_id])
    assert skipped.output_text == "Hello world"
    assert kept.output_text == "Hello world</s>"


def test_a_run_of_special_tokens_does_not_widen_the_decoded_window(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skipped special tokens never enter the window: 200 of them in a row between two words decode
    no more ids per update than the words alone, and the text is the whole output's decode."""
    assert tokenizer.special_token_ids == {0, 1, 2, 3, 4}
    words = tokenizer.encode("Hello world. The end", add_special_tokens=False)
    ids = [*words[:2], *[3, 4, 0] * 67, *words[2:]]
    decoded: list[int] = []
    real_decode = tokenizer.decode

    def counting_decode(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        decoded.append(len(token_ids))
        return real_decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    detok = IncrementalDetokenizer(tokenizer, [0, *words[:3], 2], stop=[])
    for token_id in ids:
        detok.update([token_id])
    assert detok.output_text == real_decode(ids) == "Hello world. The end"
    assert detok.output_token_ids == words
    # two windows per update of a rendered token, each at most the context plus two tokens
    assert len(decoded) == 2 * len(words) and max(decoded) <= 5


def test_stop_string_across_token_boundaries_is_trimmed(tokenizer: Tokenizer) -> None:
    text = "The end of the story is near, said the fox."
    stop = "story is near"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(stop not in tokenizer.decode([t]) for t in ids)  # the match must span tokens
    detok = IncrementalDetokenizer(tokenizer, [0], stop=["nothing like this", stop])
    matched = None
    num_fed = 0
    for token_id in ids:
        num_fed += 1
        matched = detok.update([token_id])
        if matched is not None:
            break
    assert matched == stop
    assert stop in tokenizer.decode(ids[:num_fed])
    assert stop not in tokenizer.decode(ids[: num_fed - 1])  # found on the first token that completes it
    assert detok.output_text == "The end of the "
    assert detok.update(ids[num_fed:]) is None
    assert detok.output_text == "The end of the "


def test_earliest_stop_wins_within_one_update(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the lazy dog. The end", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["end", "lazy"])
    assert detok.update(ids) == "lazy"
    assert detok.output_text == "the "


def test_streamed_deltas_hold_back_possible_stop_prefix(tokenizer: Tokenizer) -> None:
    text = "Stop here: ### and then continue"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [0], stop=["###", "and then"])
    streamed = ""
    for token_id in ids:
        matched = detok.update([token_id])
        streamed += detok.get_delta(finished=matched is not None)
        assert len(streamed) <= len(detok.output_text)
        assert "#" not in streamed
        if matched is not None:
            break
    assert matched == "###"
    assert streamed == detok.output_text == "Stop here: "


def test_holdback_releases_everything_at_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world. The quick brown fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["never appears"])
    streamed = ""
    for token_id in ids:
        assert detok.update([token_id]) is None
        streamed += detok.get_delta(finished=False)
        assert len(detok.output_text) - len(streamed) <= len("never appears") - 1
    assert len(streamed) == len(detok.output_text) - len("never appears") + 1
    streamed += detok.get_delta(finished=True)
    assert streamed == detok.output_text == "Hello world. The quick brown fox"
    assert detok.get_delta(finished=True) == ""


def test_no_stop_strings_means_no_holdback(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop=[])
    detok.update(tokenizer.encode("Hello world", add_special_tokens=False))
    assert detok.get_delta(finished=False) == "Hello world"


def test_llama3_chat_template(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"}]
    expected = (
        "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tokenizer.apply_chat_template(messages) == expected
    assert (
        tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        == expected.rsplit("<|start_header_id|>assistant", 1)[0]
    )
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    assert ids[1] == 2  # <|start_header_id|> is one special token
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected


def test_chatml_template_list_form_and_raise_exception(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(
        _write_checkpoint(tmp_path / "m", chat_template=[{"name": "default", "template": CHATML}])
    )
    assert tok is not None
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_and_missing_template(tmp_path: Path) -> None:
    no_template = Tokenizer.from_pretrained(_write_checkpoint(tmp_path / "a", chat_template=None))
    assert no_template is not None and no_template.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "Hi"}])
    model_dir = _write_checkpoint(tmp_path / "b", chat_template=None)
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}")
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok is not None
    assert tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}]) == '"<b>é</b>"'
