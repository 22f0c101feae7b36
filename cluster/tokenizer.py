"""Text <-> token ids for a Hugging Face checkpoint directory, plus its chat template.

Wraps the Rust ``tokenizers.Tokenizer`` read from ``tokenizer.json``; the special tokens and the chat
template come from ``tokenizer_config.json`` (or ``chat_template.jinja``, where newer transformers
versions save it). Nothing is fetched from a hub.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
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
        self.special_token_ids = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )

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
        # would stall every other thread of the process for seconds); ~12 us more on a short text.
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """``decode`` of each sequence, in one call that releases the GIL while it decodes."""
        return list(
            self.backend.decode_batch([list(ids) for ids in seqs], skip_special_tokens=skip_special_tokens)
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

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
        or the prompt starts with two BOS tokens. Raises ValueError when the model has no template or
        the template rejects the messages.
        """
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
        **template_kwargs: Any,
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)
