"""`Tokenizer`: text <-> token ids and chat templates for a model directory, without transformers.

Wraps `tokenizers.Tokenizer.from_file(tokenizer.json)`; the chat template comes from
`chat_template.jinja` or `tokenizer_config.json`'s "chat_template" (the two places transformers
writes it) and renders with jinja2 the way transformers' `apply_chat_template` does: a sandboxed
environment with `trim_blocks`/`lstrip_blocks`, `messages`, `add_generation_prompt`, the special
tokens (`bos_token`, `eos_token`, ...), `raise_exception` and `strftime_now`. Loaded by
`load_model` in the process that owns the model (and by the HTTP front end for chat requests).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from disagg.model.errors import ChatTemplateError, ModelConfigError

if TYPE_CHECKING:
    from disagg.model.config import ModelConfig

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A model directory's tokenizer.

    Attributes:
        eos_token_ids: ids that end a generation (the model config's and the tokenizer's EOS).
        bos_token_id: the BOS id, or None.
        chat_template: the jinja source, or None.
        special_tokens: {"bos_token": "<s>", "eos_token": ..., ...} strings the template sees.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None,
                 special_tokens: dict[str, str], eos_token_ids: tuple[int, ...],
                 source: str = "tokenizer") -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        bos = special_tokens.get("bos_token")
        self.bos_token_id = tokenizer.token_to_id(bos) if bos else None
        self.source = source
        self._compiled = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: "ModelConfig | None" = None) -> "Tokenizer":
        """Read tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from `model_dir`.

        Raises:
            ModelConfigError: tokenizer.json missing or unreadable.
        """
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelConfigError(f"{path}: cannot load tokenizer: {exc}") from exc
        settings = _read_settings(model_dir / "tokenizer_config.json")
        special = {}
        for key in _SPECIAL_KEYS:
            value = settings.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[key] = value
        eos_ids = list(config.eos_token_ids) if config is not None else []
        eos_id = tokenizer.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        return cls(tokenizer, chat_template=_read_template(model_dir, settings),
                   special_tokens=special, eos_token_ids=tuple(eos_ids), source=str(model_dir))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's own special-token post-processing)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template.

        Encode the result with `add_special_tokens=False` (the template writes BOS itself).

        Raises:
            ChatTemplateError: the directory has no chat template, or rendering failed.
        """
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source}: no chat template (neither chat_template.jinja "
                                    "nor 'chat_template' in tokenizer_config.json)")
        import jinja2

        try:
            template = self._template()
            return template.render(messages=[dict(m) for m in messages],
                                   add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens, **kwargs)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.source}: chat template failed: {exc}") from exc

    def _template(self):
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from jinja2.ext import loopcontrols
            import jinja2

            def raise_exception(message: str) -> None:
                raise jinja2.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        return self._compiled


def _read_settings(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path}: cannot read JSON: {exc}") from exc
    return settings if isinstance(settings, dict) else {}


def _read_template(model_dir: Path, settings: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's "chat_template" (a string, or a list of
    {"name", "template"} from which "default" is taken)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
