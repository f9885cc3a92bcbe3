"""Tokenizers (Hugging Face and raw sentencepiece), chat templates, incremental detokenization.

`Tokenizer.from_pretrained(path)` picks the backend:

- a directory with `tokenizer.json` / `tokenizer_config.json`: `transformers.AutoTokenizer` (local files only);
  if that fails and the directory has a `tokenizer.model` but no `tokenizer.json`, the sentencepiece backend
  (transformers 5 converts a bare sentencepiece model only with protobuf or tiktoken installed);
- a directory with only `tokenizer.model`, or a path to a `.model` file: the `sentencepiece` package.

Decoding never applies `clean_up_tokenization_spaces`: that rewrite (" ." -> ".") is not local to a few
tokens, so a streamed text could not equal the full decode, and the engine reports the model's tokens as
they are.

Imports only transformers / sentencepiece / jinja2, lazily where the backend needs them; no torch.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

_HF_FILES = ("tokenizer.json", "tokenizer_config.json")
_SP_FILE = "tokenizer.model"
_GENERATION_CONFIG = "generation_config.json"
_ROLES = ("system", "user", "assistant", "tool")
_REPLACEMENT_CHAR = "\ufffd"

# Used when the tokenizer has no chat template (always for a raw sentencepiece model):
#   "System: ...\n\nUser: ...\n\nAssistant:"
# The prompt is encoded with add_special_tokens=True, so a sentencepiece model gets its BOS.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Tools for a ChatML model whose own template does not render them (SmolLM2's): the Hermes format
# the ``hermes`` tool-call parser reads (server/tools.py), with the calls and tool results of
# earlier turns.
HERMES_TOOLS_CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You can call functions to help with the user's request. They are described in <tools></tools>:\n"
    "<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call one, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}"
    "{% for call in message.tool_calls %}<tool_call>\n{\"name\": {{ call.function.name | tojson }}, \"arguments\": "
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}"
    "\n</tool_call>\n{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Tokenizer:
    """Backend-neutral tokenizer: encode, decode, chat template, eos ids.

    Build one with `from_pretrained`; the subclasses are the backends.
    """

    vocab_size: int  # full vocabulary, added tokens included
    eos_token_ids: list[int]  # tokenizer's eos first, then generation_config.json's, no duplicates
    bos_token_id: int | None
    chat_template: str  # the Jinja template apply_chat_template renders (FALLBACK_CHAT_TEMPLATE if none)
    # Id of the "<0x80>" token when decode turns a whole run of byte-fallback tokens into U+FFFD as soon as
    # one byte in it is invalid (tokenizers' ByteFallback decoder: Llama / Mistral tokenizer.json), so
    # later tokens can change earlier text; None when decoding bytes is local. See IncrementalDetokenizer.
    byte_run_probe_id: int | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        path = os.fspath(path)
        if os.path.isfile(path):
            if not path.endswith(".model"):
                raise ValueError(f"{path}: expected a model directory or a sentencepiece .model file")
            return SentencePieceTokenizer(path, _generation_eos_ids(os.path.dirname(path)))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such tokenizer directory or .model file")
        gen_eos_ids = _generation_eos_ids(path)
        sp_file = os.path.join(path, _SP_FILE)
        has_sp = os.path.isfile(sp_file)
        if any(os.path.isfile(os.path.join(path, f)) for f in _HF_FILES):
            try:
                return HFTokenizer(path, gen_eos_ids)
            except Exception:
                # tokenizer_config.json beside a bare tokenizer.model: transformers 5 cannot convert the
                # model without protobuf/tiktoken. With a tokenizer.json the error is real.
                if not has_sp or os.path.isfile(os.path.join(path, "tokenizer.json")):
                    raise
            return SentencePieceTokenizer(sp_file, gen_eos_ids)
        if has_sp:
            return SentencePieceTokenizer(sp_file, gen_eos_ids)
        raise FileNotFoundError(f"{path}: found none of {', '.join(_HF_FILES + (_SP_FILE,))}")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        raise NotImplementedError

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id], skip_special_tokens)``, remembered per token."""
        texts = self._token_texts[skip_special_tokens]
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    @functools.cached_property
    def _token_texts(self) -> dict[bool, dict[int, str]]:
        return {False: {}, True: {}}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Render `messages` (and the OpenAI-style `tools`, if any) with the chat template and return
        the prompt's token ids.

        Each message needs a "role" in {system, user, assistant, tool} and a "content" that is a str or a
        list of {"type": "text", "text": str} parts (joined with no separator; an assistant turn with
        "tool_calls" may have none); other keys pass through to the template. Tools, tool calls and
        tool results go through the model's own template when it renders tools; a ChatML template
        that does not (SmolLM2's) is replaced by ``HERMES_TOOLS_CHATML_TEMPLATE`` for such requests;
        any other is a ValueError naming `tools`. `template_kwargs` are more variables for the template
        (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`). Raises ValueError naming the
        bad field ("messages[1].role").
        """
        messages = _normalize_messages(messages)
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template",
                                        "return_dict", "tokenizer_kwargs", "return_tensors", "conversation"})
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is set by the server, not by the request")
        template = self.chat_template
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            if "tool" not in template:
                if "<|im_start|>" not in template:
                    raise ValueError("tools: this model's chat template does not render tools or tool messages")
                template = HERMES_TOOLS_CHATML_TEMPLATE
        if template in (FALLBACK_CHAT_TEMPLATE, HERMES_TOOLS_CHATML_TEMPLATE):
            text = _compiled_template(template).render(**extra, messages=messages, tools=tools,
                                                       add_generation_prompt=add_generation_prompt)
            return self.encode(text, add_special_tokens=template == FALLBACK_CHAT_TEMPLATE)
        return self._apply_own_template(messages, add_generation_prompt, tools, extra)

    def _apply_own_template(self, messages: list[dict], add_generation_prompt: bool,
                            tools: list[dict] | None, extra: dict) -> list[int]:
        raise NotImplementedError

    def _init_eos(self, eos_token_id: int | None, gen_eos_ids: list[int]) -> None:
        ids = ([eos_token_id] if eos_token_id is not None else []) + gen_eos_ids
        self.eos_token_ids = list(dict.fromkeys(ids))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids}, "
                f"bos_token_id={self.bos_token_id})")


class HFTokenizer(Tokenizer):
    """A `transformers` tokenizer loaded with AutoTokenizer from local files."""

    def __init__(self, path: str, gen_eos_ids: list[int]) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.hf)
        self.bos_token_id = self.hf.bos_token_id
        self._init_eos(self.hf.eos_token_id, gen_eos_ids)
        template = getattr(self.hf, "chat_template", None)
        self.chat_template = template if template else FALLBACK_CHAT_TEMPLATE
        self._rust_decode = self._find_rust_decode()
        self.byte_run_probe_id = self._find_byte_run_probe()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    def _find_rust_decode(self):
        """transformers' decode of a fast tokenizer, without clean-up, is its Rust tokenizer's
        decode (called once a streamed token; the Python around it cost 3.2 us of 4 here). None
        where the class overrides either step (its own decode is kept)."""
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:
            return None
        cls = type(self.hf)
        if (isinstance(self.hf, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
                and cls._decode is TokenizersBackend._decode):
            return self.hf._tokenizer.decode
        return None

    def _find_byte_run_probe(self) -> int | None:
        ids = self.hf.convert_tokens_to_ids(["<0x61>", "<0x80>"])
        if any(i is None or i == self.hf.unk_token_id for i in ids):
            return None
        # Local decoding gives "a\ufffd"; ByteFallback drops the valid "a" with the invalid run.
        run_is_global = self.decode(ids, skip_special_tokens=False) == _REPLACEMENT_CHAR * 2
        return ids[1] if run_is_global else None

    def _apply_own_template(self, messages: list[dict], add_generation_prompt: bool,
                            tools: list[dict] | None, extra: dict) -> list[int]:
        # transformers 5 defaults to tokenize=True, return_dict=True (a BatchEncoding); with tokenize=False
        # it returns the rendered str. The template writes BOS itself, hence add_special_tokens=False.
        rendered = self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=add_generation_prompt, **extra)
        if isinstance(rendered, Mapping):
            return list(rendered["input_ids"])
        if not isinstance(rendered, str):
            raise TypeError(f"apply_chat_template returned {type(rendered).__name__}, expected str")
        return self.encode(rendered, add_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A raw sentencepiece model (`tokenizer.model`), as Llama 1/2 and Mistral ship it.

    encode(add_special_tokens=True) prepends BOS (the Llama convention); no EOS. Special tokens for
    skip_special_tokens are the control pieces (<s>, </s>, pad) and <unk>.
    """

    def __init__(self, model_file: str, gen_eos_ids: list[int]) -> None:
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.sp.get_piece_size()
        self.bos_token_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self._init_eos(self.sp.eos_id() if self.sp.eos_id() >= 0 else None, gen_eos_ids)
        self.chat_template = FALLBACK_CHAT_TEMPLATE
        self._special_ids = frozenset(
            i for i in range(self.vocab_size) if self.sp.is_control(i) or self.sp.is_unknown(i))
        self._control_ids = frozenset(i for i in self._special_ids if self.sp.is_control(i))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.sp.encode(text, out_type=int)
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return self.sp.decode([i for i in token_ids if i not in self._special_ids])
        # sentencepiece renders control pieces as "": write their piece text between decoded runs.
        parts: list[str] = []
        run: list[int] = []
        for i in token_ids:
            if i in self._control_ids:
                parts.append(self.sp.decode(run))
                parts.append(self.sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        parts.append(self.sp.decode(run))
        return "".join(parts)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self.sp.id_to_piece(i) for i in token_ids]


class IncrementalDetokenizer:
    """Per-request streaming detokenizer. UTF-8 safe: never emits a broken character mid-stream.

    Contract: "".join(add(t) for t in ids) + flush() == tokenizer.decode(ids, skip_special_tokens),
    the decode of the output tokens alone. Each delta is final: nothing emitted is ever taken back.

    Prefix-offset technique (vLLM's): decode a short window of already emitted tokens plus the new ones
    and emit the difference, so the leading-space rule of sentencepiece ("▁Hi" alone decodes to "Hi")
    and multi-token characters come out exactly as in the full decode. Text ending in U+FFFD is held
    back: the next token may complete the character. With a ByteFallback decoder (`byte_run_probe_id`)
    an open run of byte tokens is held back too, until a normal token closes it: one invalid byte
    later in the run would turn the whole run into U+FFFD in the full decode. The check decodes the
    window once more with "<0x80>" appended; the text changes before its end only while a run is open.

        output ids:  emitted, no longer read | prefix window | held back (not yet emitted)
                                             ^ prefix_offset ^ read_offset                ^ end
        emitted text == decode(ids[:read_offset])

    Only ids[prefix_offset:] are kept, so a step costs O(window): the prefix window is the tokens of
    the last delta, and the held-back tail is as long as a run of tokens whose text ends in U+FFFD
    (a character's bytes, at most 4 tokens, unless the model emits invalid UTF-8 bytes on end), or
    with ByteFallback as long as the open run of byte tokens.

    `prompt_token_ids` is accepted for callers that have it, but it is not decode context: the text is
    defined as the decode of the output alone, so a first token "▁Hi" streams as "Hi", not " Hi".
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.num_output_tokens = 0
        self._window: list[int] = []  # ids[prefix_offset:]
        self._num_prefix_tokens = 0  # read_offset - prefix_offset
        self._prefix_len = 0  # len(decode(ids[prefix_offset:read_offset]))
        self._chunks: list[str] = []
        self._text: str | None = ""
        self._flushed = False

    def add(self, token_id: int) -> str:
        """Take the next output token; return the newly final text (possibly "")."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.add after flush")
        self._window.append(token_id)
        self.num_output_tokens += 1
        new_text = self._decode(self._window)
        if len(new_text) <= self._prefix_len or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        probe_id = self.tokenizer.byte_run_probe_id
        if probe_id is not None and not self._decode(self._window + [probe_id]).startswith(new_text):
            return ""
        delta = new_text[self._prefix_len:]
        # The tokens just read become the next prefix window (most often one token: its text remembered).
        del self._window[:self._num_prefix_tokens]
        self._num_prefix_tokens = len(self._window)
        self._prefix_len = len(self.tokenizer.token_text(self._window[0], self.skip_special_tokens)
                               if self._num_prefix_tokens == 1 else self._decode(self._window))
        self._emit(delta)
        return delta

    def flush(self) -> str:
        """End of generation: emit the held-back rest (an unfinished character becomes U+FFFD)."""
        if self._flushed:
            return ""
        self._flushed = True
        new_text = self._decode(self._window)
        delta = new_text[self._prefix_len:]
        self._emit(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        if self._text is None:
            self._text = "".join(self._chunks)
        return self._text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, delta: str) -> None:
        if delta:
            self._chunks.append(delta)
            self._text = None


def _generation_eos_ids(directory: str) -> list[int]:
    """eos_token_id from generation_config.json in `directory` (int or list), or [] if absent."""
    path = os.path.join(directory, _GENERATION_CONFIG)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


def _normalize_messages(messages: Any) -> list[dict]:
    """Validate chat messages; return copies whose "content" is a str."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: expected a non-empty list of message dicts, got {messages!r:.80}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: expected a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise ValueError(f"{where}.role: expected one of {', '.join(_ROLES)}, got {role!r:.80}")
        content = message.get("content")
        if content is None and (message.get("tool_calls") or role == "tool"):
            content = ""
        out.append({**message, "content": _content_text(content, f"{where}.content")})
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: expected a str or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{where}[{j}]: expected a dict, got {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(f"{where}[{j}].type: only 'text' parts are supported, got {part.get('type')!r:.80}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text: expected a str, got {type(part.get('text')).__name__}")
        texts.append(part["text"])
    return "".join(texts)


@functools.cache
def _compiled_template(source: str) -> Any:
    import json

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)  # as transformers renders it
    return env.from_string(source)
