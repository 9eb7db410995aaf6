"""Conversations -> token ids plus answer flags, for supervised fine-tuning (SFT) data.

`tools/preprocess_data.py --chat` calls :class:`ChatEncoder` on every input line. A line is a
conversation ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` or a
prompt/response record ``{"prompt": str, "response": str}`` (the response key is the first of
``response_keys`` present), read as a user turn and an assistant turn.

Each example is ``[BOS] + rendered conversation [+ EOD]`` with one flag per token: 1 for an answer
token (the content of a target assistant turn, the end-of-turn text the template puts after it, and
the final EOD: LLaDA's "answer + EOS"), 0 for the prompt (system/user turns, the assistant header,
earlier turns that are not targets). BOS is added when the tokenizer has one and the template did not
render it; EOD is appended when the example does not already end with it.

Why segments: for a target turn ``k`` the template renders the prompt (``messages[:k]`` with the
generation prompt) and the full text (``messages[:k + 1]``) as strings; the full string must start
with the prompt string, and each segment is tokenized on its own, so the answer boundary falls exactly
where the generation prompt ends (tokenizing the whole string could merge tokens across it). A
tokenizer that starts every string with a word boundary (SentencePiece's add_dummy_prefix, as in the
bundled spm_8k) tokenizes a segment that continues the text after a newline that is then cut off, so
the segments get the ids they have inside the whole string, without a spurious space at each boundary.

Templates (``--chat-template``):

- ``auto``: a Hugging Face tokenizer's own ``chat_template`` (``tokenizer_config.json`` or
  ``chat_template.jinja`` beside ``tokenizer.json``), else ``builtin``.
- ``builtin`` (:data:`BUILTIN_TEMPLATE`), for tokenizers without one (SentencePiece)::

      <|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{answer}<EOD><|user|>\\n...

  ``<|system|>``, ``<|user|>`` and ``<|assistant|>`` are ordinary text; ``<EOD>`` is the tokenizer's
  end-of-document id, so every answer (in the loss) ends with it.
- ``none`` (:data:`PLAIN_TEMPLATE`): plain concatenation; system and user contents are joined with
  newlines, a response follows its prompt directly, and a newline leads into the next turn.
- ``PATH.jinja``: a template file of your own, written like Hugging Face's.

Templates are rendered with jinja2 in a sandbox, with the variables Hugging Face gives them
(``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``,
``strftime_now``). A special token that the tokenizer does not read back from its own text
(SentencePiece control symbols) is passed to the template as a placeholder that becomes its id.
No torch, no transformers: the preprocessing tool starts without them.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import jinja2
import jinja2.ext
import jinja2.sandbox

TEMPLATE_CHOICES = ("auto", "builtin", "none")
TURN_CHOICES = ("all", "sampled", "each")
ROLES = ("system", "user", "assistant")
DEFAULT_RESPONSE_KEYS = ("response", "completion", "answer")

# Newlines are written as {{ "\n" }}: trim_blocks (as Hugging Face renders) eats one after a block tag.
BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message.role }}|>{{ '\\n' }}{{ message.content }}"
    "{% if message.role == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}")
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first and message.role != 'assistant' %}{{ '\\n' }}{% endif %}{{ message.content }}"
    "{% endfor %}")
# Text that continues a segment is tokenized after this (then cut off), so that a dummy-prefix tokenizer
# tokenizes it as inside the whole string; a newline, since templates put one before most segments.
_ANCHOR = "\n"
# Private-use characters: a placeholder for a special id can only come from the template variables.
_PLACEHOLDER = "\ue000{}\ue001"

Example = Tuple[List[int], List[int]]  # (token ids, answer flags)


class ChatError(ValueError):
    """A line that cannot become an SFT example; the message says why (the caller adds the line)."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(date_format: str) -> str:
    return datetime.datetime.now().strftime(date_format)


def compile_template(source: str) -> jinja2.Template:
    """The template in a sandbox set up as Hugging Face does (trim_blocks, lstrip_blocks, loop controls)."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    # json.dumps keeps non-ASCII text as it is, as Hugging Face's own tojson does.
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return environment.from_string(source)


def _hf_template(tokenizer) -> Optional[str]:
    """The chat template shipped with a Hugging Face tokenizer, or None (also for other tokenizers)."""
    tokenizer_file = getattr(tokenizer, "tokenizer_file", None)
    if tokenizer_file is None:
        return None
    folder = os.path.dirname(os.path.abspath(tokenizer_file))
    config_path = os.path.join(folder, "tokenizer_config.json")
    template = None
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as handle:
            template = json.load(handle).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if not isinstance(template, str) and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as handle:
            template = handle.read()
    return template if isinstance(template, str) and template else None


def resolve_template(spec: str, tokenizer) -> Tuple[str, str]:
    """(template source, a name for messages) for a --chat-template value; ValueError if unusable."""
    source, name = _template_source(spec, tokenizer)
    try:
        compile_template(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"--chat-template {spec}: {name} is not a valid jinja template "
                         f"(line {error.lineno}: {error.message}); fix it or pass --chat-template builtin") from None
    return source, name


def _template_source(spec: str, tokenizer) -> Tuple[str, str]:
    if spec == "builtin":
        return BUILTIN_TEMPLATE, "builtin"
    if spec == "none":
        return PLAIN_TEMPLATE, "none"
    if spec == "auto":
        try:
            source = _hf_template(tokenizer)
        except (OSError, ValueError) as error:
            raise ValueError(f"--chat-template auto: cannot read the tokenizer's chat template ({error}); "
                             "fix the file or pass --chat-template builtin") from None
        return (source, "the tokenizer's chat_template") if source else (BUILTIN_TEMPLATE, "builtin")
    if not os.path.isfile(spec):
        raise ValueError(f"--chat-template {spec}: no such file; give a .jinja file or one of "
                         f"{', '.join(TEMPLATE_CHOICES)}")
    try:
        with open(spec, encoding="utf-8") as handle:
            return handle.read(), spec
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--chat-template {spec}: cannot read it ({error}); give a UTF-8 .jinja file") from None


def record_messages(record: dict, prompt_key: str = "prompt",
                    response_keys: Sequence[str] = DEFAULT_RESPONSE_KEYS) -> List[Dict[str, str]]:
    """The checked messages of a conversation or prompt/response record; ChatError if malformed."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ChatError("'messages' is not a non-empty list")
        for number, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ChatError(f"messages[{number}] is not an object")
            if message.get("role") not in ROLES:
                raise ChatError(f"messages[{number}] has role {message.get('role')!r}; use one of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise ChatError(f"messages[{number}] has no string 'content'")
        if not any(message["role"] == "assistant" for message in messages):
            raise ChatError("the conversation has no assistant turn to learn")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    response_key = next((key for key in response_keys if key in record), None)
    if prompt_key not in record or response_key is None:
        raise ChatError(f"neither 'messages' nor {prompt_key!r} with one of {', '.join(map(repr, response_keys))}")
    for key in (prompt_key, response_key):
        if not isinstance(record[key], str):
            raise ChatError(f"field {key!r} is not a string")
    return [{"role": "user", "content": record[prompt_key]}, {"role": "assistant", "content": record[response_key]}]


def target_turns(messages: Sequence[dict], turns: str, seed: int, line_number: int) -> List[List[int]]:
    """The assistant-turn indices each example learns, one list per example.

    `sampled` draws one turn from a hash of (seed, line number) rather than a shared generator, so
    the draw does not depend on which process or partition reads the line.
    """
    answers = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    if turns == "all":
        return [answers]
    if turns == "each":
        return [[k] for k in answers]
    if turns == "sampled":
        digest = hashlib.sha256(f"{seed}:{line_number}".encode()).digest()
        return [[answers[int.from_bytes(digest[:8], "little") % len(answers)]]]
    raise ValueError(f"--chat-turns {turns}: choose one of {', '.join(TURN_CHOICES)}")


class ChatEncoder:
    """Renders records with one template and tokenizes them into (ids, answer flags) examples."""

    def __init__(self, tokenizer, template_source: str, turns: str = "all", seed: int = 1234,
                 prompt_key: str = "prompt", response_keys: Sequence[str] = DEFAULT_RESPONSE_KEYS) -> None:
        self.tokenizer, self.turns, self.seed = tokenizer, turns, seed
        self.prompt_key, self.response_keys = prompt_key, tuple(response_keys)
        self.template = compile_template(template_source)
        self.bos_token, self.eos_token = self._special_text(tokenizer.bos), self._special_text(tokenizer.eod)
        placeholders = {text: token_id for text, token_id in
                        ((self.bos_token, tokenizer.bos), (self.eos_token, tokenizer.eod)) if text.startswith("\ue000")}
        self._placeholder_ids = placeholders
        self._placeholder_split = (re.compile("(" + "|".join(map(re.escape, placeholders)) + ")")
                                   if placeholders else None)
        self._anchor_ids = tokenizer.tokenize(_ANCHOR) if self._adds_dummy_prefix() else None

    def _adds_dummy_prefix(self) -> bool:
        """True for SentencePiece models with add_dummy_prefix: they start every tokenized string with a
        word boundary, which at each segment boundary would be a space that the text does not have."""
        try:
            return self.tokenizer.detokenize(self.tokenizer.tokenize("a") + self.tokenizer.tokenize("b")) != "ab"
        except ValueError:  # a tokenizer that reads no words (NullTokenizer) has no such prefix
            return False

    def _special_text(self, token_id: Optional[int]) -> str:
        """How the template writes a special id: its own text if the tokenizer reads that back as the
        id (Hugging Face added tokens), else a placeholder turned into the id after rendering."""
        if token_id is None:
            return ""
        text = self.tokenizer.detokenize([token_id])
        if text and self.tokenizer.tokenize(text) == [token_id]:
            return text
        return _PLACEHOLDER.format(token_id)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError) as error:
            raise ChatError(f"the chat template failed ({error})") from None

    def segments(self, messages: Sequence[dict], targets: Sequence[int]) -> List[Tuple[str, bool]]:
        """(text, is_answer) pieces of the conversation up to the last target turn."""
        pieces, done = [], ""
        for k in targets:
            prompt, full = self.render(messages[:k], True), self.render(messages[:k + 1], False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise ChatError(f"the chat template's text for messages[:{k}] with the generation prompt is not a "
                                f"prefix of its text for messages[:{k + 1}] (it rewrites earlier turns); use "
                                "--chat-turns sampled/each or another --chat-template")
            pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        return pieces

    def _piece_ids(self, text: str, continues: bool) -> List[int]:
        if not continues or self._anchor_ids is None:
            return self.tokenizer.tokenize(text)
        ids = self.tokenizer.tokenize(_ANCHOR + text)
        anchor = len(self._anchor_ids)
        # If the anchor merged into the text, the plain ids are the best left (a word boundary more).
        return ids[anchor:] if ids[:anchor] == self._anchor_ids else self.tokenizer.tokenize(text)

    def text_ids(self, text: str, continues: bool = False) -> List[int]:
        """Ids of rendered text, with the placeholders of special tokens replaced by their ids;
        `continues`: the text follows earlier text of the example (no dummy prefix)."""
        parts = self._placeholder_split.split(text) if self._placeholder_split is not None else [text]
        ids: List[int] = []
        for part in parts:
            if part in self._placeholder_ids:
                ids.append(self._placeholder_ids[part])
            elif part:
                ids.extend(self._piece_ids(part, continues or bool(ids)))
        return ids

    def encode_conversation(self, messages: Sequence[dict], targets: Sequence[int]) -> Example:
        ids: List[int] = []
        flags: List[int] = []
        for text, is_answer in self.segments(messages, targets):
            piece = self.text_ids(text, continues=bool(ids))
            ids += piece
            flags += [int(is_answer)] * len(piece)
        bos, eod = self.tokenizer.bos, self.tokenizer.eod
        if bos is not None and (not ids or ids[0] != bos):
            ids, flags = [bos] + ids, [0] + flags
        if not ids or ids[-1] != eod:
            ids, flags = ids + [eod], flags + [1]
        return ids, flags

    def encode_record(self, record: dict, line_number: int) -> List[Example]:
        """Every example of one input line (several with --chat-turns each); ChatError if malformed."""
        messages = record_messages(record, self.prompt_key, self.response_keys)
        return [self.encode_conversation(messages, targets)
                for targets in target_turns(messages, self.turns, self.seed, line_number)]
