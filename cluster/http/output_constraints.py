"""What constrains a request's output, parsed at the HTTP edge: structured outputs and tool calling.

Structured outputs come from OpenAI's ``response_format`` (``json_object`` / ``json_schema``), vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` or its newer
``structured_outputs`` object; at most one of them per request. Tools: ``tools`` reach the chat
template; ``tool_choice`` "required" or a named function constrains the output to JSON that the
response turns into ``tool_calls``; "none" leaves the output free. "auto" leaves it free too and has the
server's ``--tool-call-parser`` find calls in the text (``cluster/http/tool_parsers.py``); a server
started without ``--enable-auto-tool-choice`` refuses it. Every field pdserve knows but does not
implement is a 400 naming it (:data:`UNSUPPORTED`), so nothing a client asks for is silently dropped.

The result is a :class:`Constraints`: the :class:`StructuredOutput` spec for the worker's token mask and,
for tool calls, how to render the output. No torch, no xgrammar here (the worker compiles the spec).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from cluster.config import MAX_GRAMMAR_RULES, MAX_STRUCTURED_SPEC_CHARS
from cluster.http.tool_parsers import PARSERS
from cluster.protocol import ErrorCode, StructuredOutput

MAX_CHOICES = 256
MAX_SPEC_CHARS = MAX_STRUCTURED_SPEC_CHARS  # EngineConfig's defaults, which the worker checks again

# Fields of OpenAI's or vLLM's request bodies that pdserve does not implement, with the values that
# mean "not used" (accepted); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "guided_whitespace_pattern": (None,),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0, 1),
    "truncate_prompt_tokens": (None,),
    "lora_request": (None,),
    "logits_processors": (None, []),
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "chat_template": (None,),
    "documents": (None,),
    "continue_final_message": (None, False),
    "mm_processor_kwargs": (None,),
}
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_OUTPUTS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "structural_tag": (None,),
    "whitespace_pattern": (None,),
    "disable_any_whitespace": (None, True, False),
    "disable_fallback": (None, True, False),
    "disable_additional_properties": (None, False),
    "backend": (None, "xgrammar", "auto"),
}


class ConstraintError(ValueError):
    """A 400: ``param`` names the field."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _fail(message: str, param: str, code: str | None = None) -> ConstraintError:
    return ConstraintError(message[:500], param, code)


@dataclass(frozen=True)
class ToolCalls:
    """How to render an output as tool calls: "named" (the output is the named function's arguments),
    "required" (the output is a JSON list of {"name", "parameters"}) or "auto" (free text; ``parser``,
    a name in ``cluster/http/tool_parsers.py``, finds the calls)."""

    mode: Literal["named", "required", "auto"]
    name: str | None = None
    parser: str | None = None


@dataclass(frozen=True)
class Constraints:
    """structured: the spec for the worker (None: free text); tools: the request's tool definitions
    for the chat template; tool_calls: set when the output must be rendered as tool calls; param: the
    field the spec came from (for error messages)."""

    structured: StructuredOutput | None = None
    tools: list[dict[str, Any]] | None = None
    tool_calls: ToolCalls | None = None
    param: str | None = None

    @property
    def skip_special_tokens(self) -> bool:
        """False where the tool-call parser's markers are special tokens in some models (vLLM's
        ``adjust_request``): the text must keep them for the parser to see them."""
        mode = self.tool_calls
        return mode is None or mode.parser is None or PARSERS[mode.parser].skip_special_tokens


def check_unsupported(raw: dict[str, Any]) -> None:
    """400 for a known-but-unimplemented field given a value that would change the answer."""
    for name, neutral in UNSUPPORTED.items():
        if name in raw and not any(raw[name] == v and type(raw[name]) is type(v) for v in neutral):
            if name in ("functions", "function_call"):
                raise _fail(f"{name} is not supported (the legacy form): use tools and tool_choice", name)
            raise _fail(f"{name} is not supported by pdserve (got {json.dumps(raw[name])[:80]})", name)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _fail(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise _fail(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
    text = json.dumps(schema, ensure_ascii=False, sort_keys=True)
    if len(text) > MAX_SPEC_CHARS:
        raise _fail(f"{param} is longer than {MAX_SPEC_CHARS} characters", param)
    return text


def _choices(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _fail(f"{param} must be a non-empty list of non-empty strings", param)
    if len(value) > MAX_CHOICES:
        raise _fail(f"{param} may hold at most {MAX_CHOICES} choices, got {len(value)}", param)
    return StructuredOutput("choice", choices=list(dict.fromkeys(value)))


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(f"{param} must be a non-empty string", param)
    if len(value) > MAX_SPEC_CHARS:
        raise _fail(f"{param} is longer than {MAX_SPEC_CHARS} characters", param)
    return value


def _grammar(value: Any, param: str) -> StructuredOutput:
    spec = StructuredOutput("grammar", _text(value, param))
    if spec.num_grammar_rules > MAX_GRAMMAR_RULES:
        raise _fail(
            f"{param} has {spec.num_grammar_rules} rules, over the limit of {MAX_GRAMMAR_RULES}",
            param,
            ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX.value,
        )
    return spec


def _response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _fail("response_format must be an object with a type", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _fail("response_format.json_schema must be an object with a schema", param)
        return StructuredOutput("json", _schema_text(spec["schema"], "response_format.json_schema.schema"))
    raise _fail(f"response_format.type must be text, json_object or json_schema, got {kind!r}", param)


def _structured_outputs(value: Any) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _fail("structured_outputs must be an object", param)
    for key, neutral in _STRUCTURED_OUTPUTS_NEUTRAL.items():
        if key in value and value[key] not in neutral:
            raise _fail(f"structured_outputs.{key} is not supported by pdserve", param)
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_NEUTRAL) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise _fail(f"structured_outputs has unknown key(s) {unknown}", param)
    given = [k for k in _STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise _fail(
            f"structured_outputs needs exactly one of {list(_STRUCTURED_OUTPUTS_KEYS)}, got {given}", param
        )
    key = given[0]
    where = f"structured_outputs.{key}"
    if key == "json":
        return StructuredOutput("json", _schema_text(value[key], where))
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "choice":
        return _choices(value[key], where)
    if key == "grammar":
        return _grammar(value[key], where)
    return StructuredOutput(key, _text(value[key], where))


def parse_structured(raw: dict[str, Any]) -> tuple[StructuredOutput | None, str | None]:
    """The structured-output spec of a body and the field it came from (at most one may be given)."""
    found: list[tuple[StructuredOutput | None, str]] = []
    if raw.get("response_format") is not None:
        found.append((_response_format(raw["response_format"]), "response_format"))
    if raw.get("guided_json") is not None:
        found.append(
            (StructuredOutput("json", _schema_text(raw["guided_json"], "guided_json")), "guided_json")
        )
    if raw.get("guided_regex") is not None:
        found.append((StructuredOutput("regex", _text(raw["guided_regex"], "guided_regex")), "guided_regex"))
    if raw.get("guided_choice") is not None:
        found.append((_choices(raw["guided_choice"], "guided_choice"), "guided_choice"))
    if raw.get("guided_grammar") is not None:
        found.append((_grammar(raw["guided_grammar"], "guided_grammar"), "guided_grammar"))
    if raw.get("structured_outputs") is not None:
        found.append((_structured_outputs(raw["structured_outputs"]), "structured_outputs"))
    backend = raw.get("guided_decoding_backend")
    if backend is not None and backend not in ("xgrammar", "auto"):
        raise _fail(
            f"guided_decoding_backend must be xgrammar (pdserve's only backend), got {backend!r}",
            "guided_decoding_backend",
        )
    found = [(spec, param) for spec, param in found if spec is not None]
    if len(found) > 1:
        names = [param for _, param in found]
        raise _fail(f"give at most one of {names} (each constrains the whole output)", names[1])
    return found[0] if found else (None, None)


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _fail("tools must be a non-empty list", "tools")
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _fail(f'{where}.type must be "function" (the only tool type pdserve supports)', "tools")
        function = tool.get("function")
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise _fail(f"{where}.function must be an object with a non-empty name", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _fail(f"{where}.function.parameters must be a JSON schema object", "tools")
    names = [t["function"]["name"] for t in value]
    if len(set(names)) != len(names):
        raise _fail(
            f"tools have duplicate function names {sorted(n for n in set(names) if names.count(n) > 1)}",
            "tools",
        )
    return list(value)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if parameters is not None else {"type": "object", "properties": {}}


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_constraints(raw: dict[str, Any], *, chat: bool, tool_call_parser: str | None = None) -> Constraints:
    """Everything that constrains the output of one body; raises ConstraintError naming the field.
    tool_call_parser: the server's parser for tool_choice "auto" (None: "auto" is refused)."""
    check_unsupported(raw)
    structured, param = parse_structured(raw)
    if not chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if raw.get(name) is not None:
                raise _fail(f"{name} is a chat field (/v1/chat/completions)", name)
        return Constraints(structured, param=param)
    tools = _tools(raw["tools"]) if raw.get("tools") is not None else None
    choice = raw.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = raw.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _fail("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice == "none":
        return Constraints(structured, tools, None, param)
    if tools is None:
        raise _fail(f"tool_choice {json.dumps(choice)[:60]} needs tools", "tool_choice")
    if structured is not None:
        raise _fail(
            f"{param} and tool_choice {json.dumps(choice)[:60]} both constrain the output; give one",
            "tool_choice",
        )
    if choice == "auto":
        if tool_call_parser is None:
            raise _fail(
                'tool_choice "auto" (the default when tools are given) is not supported: this server has '
                "no parser for free-text tool calls (start it with --enable-auto-tool-choice and "
                f"--tool-call-parser {{{','.join(sorted(PARSERS))}}}); "
                'or send tool_choice "required", a named function, or "none"',
                "tool_choice",
            )
        return Constraints(None, tools, ToolCalls("auto", parser=tool_call_parser))
    if choice == "required":
        schema = _required_schema(tools, parallel is not False)
        return Constraints(
            StructuredOutput("json", json.dumps(schema)), tools, ToolCalls("required"), "tool_choice"
        )
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        matching = [t for t in tools if t["function"]["name"] == name]
        if not matching:
            raise _fail(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        schema_text = json.dumps(_parameters(matching[0]), ensure_ascii=False, sort_keys=True)
        return Constraints(
            StructuredOutput("json", schema_text), tools, ToolCalls("named", name), "tool_choice"
        )
    raise _fail(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )
