"""Text tokenizer for the LLM engine: HF tokenizer.json or GGUF metadata, chat templates, streaming decode.

Both sources end up as a ``tokenizers.Tokenizer`` (the Rust HF library), so encode/decode behave
the same whichever file the model came from. Chat templates are rendered with jinja2 the way
transformers does (sandboxed, trim_blocks/lstrip_blocks, ``raise_exception``, a non-HTML-escaping
``tojson``), with the special tokens passed in as variables.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from realtime.errors import ConfigError, ModelFormatError, UnsupportedError

__all__ = ["TextTokenizer", "StreamDecoder", "gguf_metadata"]

# GGUF token_type values (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer regexes of the BPE families llama.cpp names in tokenizer.ggml.pre (same patterns as in
# those models' tokenizer.json files).
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=use_regex)


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in ("gpt2", "gpt-2", "default"):
        return _byte_level(True)
    if pre == "smollm":
        # SmolLM: every digit is its own pre-token, then the GPT-2 byte-level split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level(True)])
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_RE), behavior="isolated", invert=False), _byte_level(False)]
        )
    if pre in ("qwen2", "qwen3"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_RE), behavior="isolated", invert=False), _byte_level(False)]
        )
    raise UnsupportedError(f"GGUF pre-tokenizer {pre!r} is not supported (gpt2, smollm, llama-bpe, qwen2)")


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields of a ``gguf.GGUFReader`` as plain Python values."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


class TextTokenizer:
    """encode/decode text <-> token ids, plus the model's chat template and special ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token: str | None,
        eos_tokens: Iterable[str],
        chat_template: str | None,
        special_strings: Mapping[str, str] | None = None,
    ) -> None:
        self.tok = tokenizer
        self.bos_token = bos_token
        self.bos_id: int | None = tokenizer.token_to_id(bos_token) if bos_token is not None else None
        eos_tokens = list(eos_tokens)
        ids = {tokenizer.token_to_id(t) for t in eos_tokens}
        self.eos_ids: set[int] = {i for i in ids if i is not None}
        self.eos_token = next(iter(eos_tokens), None)
        self.chat_template = chat_template
        self.special_strings = dict(special_strings or {})
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "TextTokenizer":
        """From a HF checkpoint folder: tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json / config.json for the eos ids)."""
        folder = Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise ConfigError(f"{folder} has no tokenizer.json")
        tok = Tokenizer.from_file(str(tj))
        tcfg = _read_json(folder / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        def as_str(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        bos = as_str(tcfg.get("bos_token"))
        eos = as_str(tcfg.get("eos_token"))
        eos_tokens = [eos] if eos else []
        # generation_config/config eos ids (Llama 3 lists several) also stop generation.
        for extra in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
            e = extra.get("eos_token_id")
            for i in e if isinstance(e, list) else [e] if e is not None else []:
                t = tok.id_to_token(int(i))
                if t is not None and t not in eos_tokens:
                    eos_tokens.append(t)
        special = {k: as_str(tcfg[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if tcfg.get(k)}
        return cls(tok, bos_token=bos, eos_tokens=eos_tokens, chat_template=template, special_strings=special)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "TextTokenizer":
        """From GGUF key/values (see ``gguf_metadata``); only tokenizer.ggml.model == "gpt2" (byte-level BPE)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedError(f"GGUF tokenizer model {kind!r} is not supported (only gpt2 byte-level BPE)")
        try:
            tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
            merges_raw: list[str] = list(meta["tokenizer.ggml.merges"])
        except KeyError as e:
            raise ModelFormatError(f"GGUF file lacks {e.args[0]}") from None
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = []
        for m in merges_raw:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ModelFormatError(f"bad GGUF merge {m!r}")
            merges.append((a, b))
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        # Control tokens are matched in text and dropped by decode(skip_special); user-defined ones are
        # matched but kept.
        special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _TOKEN_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        tok.pre_tokenizer = _gguf_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "gpt2")))
        tok.decoder = decoders.ByteLevel()

        def tok_at(key: str) -> str | None:
            i = meta.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        bos, eos = tok_at("tokenizer.ggml.bos_token_id"), tok_at("tokenizer.ggml.eos_token_id")
        eos_tokens = [t for t in (eos, tok_at("tokenizer.ggml.eot_token_id"), tok_at("tokenizer.ggml.eom_token_id")) if t]
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
            specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
            tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
        strings = {
            k: v
            for k, v in (
                ("bos_token", bos),
                ("eos_token", eos),
                ("unk_token", tok_at("tokenizer.ggml.unknown_token_id")),
                ("pad_token", tok_at("tokenizer.ggml.padding_token_id")),
            )
            if v is not None
        }
        return cls(
            tok,
            bos_token=bos,
            eos_tokens=list(dict.fromkeys(eos_tokens)),
            chat_template=meta.get("tokenizer.chat_template"),
            special_strings=strings,
        )

    # ---- use ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Text -> ids. Special-token strings in ``text`` become their ids; ``add_special`` adds BOS/EOS
        as the model's post-processor specifies."""
        return self.tok.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (part of a UTF-8 character, for some): through
        the byte-level alphabet where the decoder is byte-level BPE, a ``<0xNN>`` byte-fallback
        token as its byte, else its decoded text."""
        piece = self.tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if isinstance(self.tok.decoder, decoders.ByteLevel) and self.tok.token_to_id(piece) is not None:
            table = _byte_alphabet()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.tok.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt string (HF conventions: ``messages``,
        ``add_generation_prompt``, ``bos_token``/``eos_token`` variables)."""
        if not self.chat_template:
            raise UnsupportedError("this model has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables = {**self.special_strings, **kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte -> the
    byte (printable Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class _Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; render its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelFormatError(f"chat template does not parse: {e}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path.name} is not valid JSON: {e}") from None


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns only the newly completed text.

    Decodes a short window of recent ids and emits the difference to the text already emitted for
    that window, holding back while the tail is an incomplete UTF-8 sequence (decoded as U+FFFD) —
    so multi-byte characters split over tokens and leading-space rules of the decoder both come out
    right. ``flush()`` returns whatever is still held.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids before this have been emitted

    def reset(self) -> None:
        self.ids.clear()
        self.prefix = self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=self.skip_special)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            new = full[len(prefix_text) :]
            # The next window starts at the ids just emitted (context for spacing rules); older ids are dropped.
            del self.ids[: self.read]
            self.prefix, self.read = 0, len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text) :]
