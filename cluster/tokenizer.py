"""Text <-> token ids for a Hugging Face checkpoint directory, plus its chat template.

Wraps the Rust ``tokenizers.Tokenizer`` read from ``tokenizer.json``; the special tokens and the chat
template come from ``tokenizer_config.json`` (or ``chat_template.jinja``, where newer transformers
versions save it). Nothing is fetched from a hub.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores a special token either as its text or as a serialised AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _pick_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: jinja's builtin tojson HTML-escapes <, > and &, which would corrupt prompts; this one takes
    # the arguments transformers' chat-template tojson takes (templates pass indent, separators, ...).
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=tuple(separators) if separators is not None else None,  # type: ignore[arg-type]
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# NOTE: the names a chat template gets from the server, never from a client's chat_template_kwargs: the
# variables transformers passes (the conversation, the special tokens) and the template's globals. A
# client setting bos_token or raise_exception would rewrite the template's own control text.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
        "range",
        "dict",
        "lipsum",
        "cycler",
        "joiner",
        "namespace",
    }
)


class _LiteralSpecials:
    """Client text kept from becoming control tokens: every special-token string in it is swapped for a
    marker before the template renders (``escape``), and put back as plain text after (``restore``).

    The marker is ASCII letters and digits with a per-render random nonce: it survives whatever the
    template does to the text (tojson, trim, upper) and a client cannot forge one.
    """

    def __init__(self, pattern: re.Pattern[str] | None) -> None:
        self._pattern = pattern
        self._nonce = f"PDSVLIT{secrets.randbelow(10**12):012d}N"
        self.marker = re.compile(re.escape(self._nonce) + r"(\d+)Z", re.IGNORECASE)
        self.originals: list[str] = []

    def escape(self, value: Any) -> Any:
        if isinstance(value, str):
            return value if self._pattern is None else self._pattern.sub(self._mark, value)
        if isinstance(value, Mapping):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape(v) for v in value]
        return value

    def _mark(self, match: re.Match[str]) -> str:
        self.originals.append(match.group())
        return f"{self._nonce}{len(self.originals) - 1}Z"

    def restore(self, text: str) -> str:
        def original(match: re.Match[str]) -> str:
            index = int(match.group(1))
            return self.originals[index] if index < len(self.originals) else match.group()

        return self.marker.sub(original, text)


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, special token ids and chat template rendering."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token is not None else None
        eos_ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos_ids, *extra_eos_token_ids]))
        # the ids ``decode(..., skip_special_tokens=True)`` leaves out
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self._added_token_ids = frozenset(added)
        specials = sorted({added[i].content for i in self.special_token_ids}, key=len, reverse=True)
        # NOTE: longest first, so a special token that contains another is marked whole.
        self._special_pattern = re.compile("|".join(map(re.escape, specials))) if specials else None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer | None:
        """Load from a checkpoint directory; None when it has no tokenizer.json.

        eos_token_ids also gathers generation_config.json's eos_token_id (Llama-3 instruct ends turns
        with <|eot_id|>, which only appears there).
        """
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            return None
        config = _read_json(model_dir / "tokenizer_config.json")
        generation_eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        return cls(
            tokenizers.Tokenizer.from_file(str(tokenizer_file)),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=_pick_chat_template(model_dir, config),
            extra_eos_token_ids=[t for t in generation_eos or [] if isinstance(t, int)],
        )

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: encode_batch releases the GIL while the Rust side works (encode holds it: a 1 MiB prompt
        # would stall every other thread of the process for seconds); ~12 us more on a short text. The
        # _fast variant (tokenizers >= 0.20) skips offsets: the same ids, and the Encoding it returns
        # converts and frees in ~40 ms instead of holding the GIL ~0.5 s for a 1 MiB prompt.
        (encoding,) = self._encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    @cached_property
    def _encode_batch_fast(self) -> Any:
        return getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)

    @cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters one token stands for: the longest token in the vocabulary
        (byte-level tokens spell one byte per character, so never fewer than the text they stand for).
        A text longer than ``n`` x this cannot encode to fewer than ``n`` tokens."""
        return max((len(token) for token in self.backend.get_vocab(with_added_tokens=True)), default=1)

    @cached_property
    def _literal_backend(self) -> tokenizers.Tokenizer:
        # NOTE: a copy that reads special-token strings as text (encode_special_tokens); the shared
        # backend keeps parsing them, and toggling its flag per call would race other threads.
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """``decode`` of each sequence, in one call that releases the GIL while it decodes."""
        return list(
            self.backend.decode_batch([list(ids) for ids in seqs], skip_special_tokens=skip_special_tokens)
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """``SamplingParams.bad_words`` as token sequences, by vLLM's rule
        (``SamplingParams.update_from_tokenizer``): each distinct word, its leading whitespace stripped, is
        encoded without special tokens; then once more after one space, and that form is kept too when it
        starts with another token and has as many tokens (the word in mid-text, where byte-level BPEs spell
        it with its space). ValueError when a word encodes to no token at all."""
        token_ids: list[list[int]] = []
        for word in dict.fromkeys(words):
            bare = self.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words entry {word[:40]!r} encodes to no token")
            token_ids.append(bare)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                token_ids.append(spaced)
        return token_ids

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this model has no chat template (chat_template in tokenizer_config.json)")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render the conversation to prompt text.

        Messages keep every key they carry (``tool_calls``, ``tool_call_id``, ``name``); ``tools`` (OpenAI
        function definitions) and ``template_kwargs`` (a request's ``chat_template_kwargs``, e.g. Qwen3's
        ``enable_thinking``) become template variables, as in transformers. The template already writes
        bos_token itself, so encode the result with ``add_special_tokens=False`` (``encode_chat`` does)
        or the prompt starts with two BOS tokens. Raises ValueError when the model has no template, the
        template rejects the messages, or ``template_kwargs`` names a reserved variable
        (``RESERVED_TEMPLATE_NAMES``).

        The text holds the messages' special-token strings as they are: encoding it parses them as
        control tokens. ``encode_chat`` is the safe way to get a prompt's ids.
        """
        reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(template_kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}")
        variables: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **template_kwargs,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        if tools is not None:
            variables["tools"] = list(tools)
        try:
            return self._compiled_template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e
        except (TypeError, AttributeError, KeyError) as e:
            # NOTE: a template indexing a message field a client left out fails with these, not with
            # a TemplateError; it is still the request's fault.
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The conversation's prompt ids: only the template's own text yields control tokens.

        Special-token strings in what the client sent (message contents, names, tool calls, ``tools``,
        ``template_kwargs`` values) are encoded as the plain text they spell: a user who writes
        ``<|im_end|>`` gets the ids of those characters, never the turn delimiter. For a conversation
        without such strings the ids are exactly ``encode(apply_chat_template(...))``.
        """
        literals = _LiteralSpecials(self._special_pattern)
        text = self.apply_chat_template(
            literals.escape(list(messages)),
            add_generation_prompt,
            literals.escape(tools) if tools is not None else None,
            **literals.escape(dict(template_kwargs or {})),
        )
        if not literals.originals:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return self._encode_with_literals(text, literals, add_special_tokens)

    def _encode_with_literals(
        self, text: str, literals: _LiteralSpecials, add_special_tokens: bool
    ) -> list[int]:
        """Encode ``text`` (rendered with markers) as usual, then re-encode each stretch between two added
        tokens that holds a marker, with its client text put back and special tokens read as text.

        NOTE: the added tokens split the text for the tokenizer too (each stretch between them is
        normalized and pre-tokenized on its own), so a stretch re-encoded alone gets the ids it would get
        in place; the library's own split (offsets) decides where the stretches are.
        """
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = []
        stretch_ids: list[int] = []
        stretch_start = 0

        def flush(end: int) -> None:
            stretch = text[stretch_start:end]
            if literals.marker.search(stretch):
                (plain,) = self._literal_backend.encode_batch(
                    [literals.restore(stretch)], add_special_tokens=False
                )
                ids.extend(plain.ids)
            else:
                ids.extend(stretch_ids)
            stretch_ids.clear()

        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self._added_token_ids:
                flush(start)
                ids.append(token_id)
                stretch_start = max(stretch_start, end)
            else:
                stretch_ids.append(token_id)
        flush(len(text))
        return ids
