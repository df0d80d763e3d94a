"""Whether an engine replica tokenizes as this server does.

Token-exactness rests on the session server and the engine sharing one tokenizer: the server
renders the prompt ids the engine samples after, and decodes what it sampled. A tokenizer of
another model, or of another revision of the same model, breaks that without any error. So
every replica is probed before it serves (at start-up, when discovery adds it, when it comes
back from being down): `POST /tokenize` of a fixed text holding the tokenizer's special
tokens and its chat template's markers (vLLM 0.32 and SGLang 0.5.23 both answer it, with
`{"tokens": [...]}`; vLLM's `/tokenizer_info` is off unless the engine is started with
`--enable-tokenizer-info-endpoint`), and the ids compared with this server's own.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)

PROBE_PATH = "/tokenize"
PROBE_TEXT = "Token-exact probe: naïve café, 東京, Ελληνικά, 🚀 emoji, tab\tand  spaces, `f(x)`\n"
"""Words, scripts and whitespace whose pieces differ between vocabularies."""
UNCHECKED = "unchecked: not yet compared with this server's tokenizer"
"""A replica's `tokenizer_differs` until its probe answered (it gets no turns meanwhile)."""
NO_TOKENIZE_STATUSES = frozenset({404, 405, 501})
"""An engine that has no tokenize endpoint: it cannot be compared (warned, then served)."""


@dataclass(frozen=True)
class TokenizerProbe:
    """The probe text and the ids this server's tokenizer gives it."""

    text: str
    token_ids: list[int]

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerProbe:
        """`tokenizer`: a `FastTokenizer` (its `hf` tokenizer has the special tokens and the
        chat template)."""
        specials = "".join(sorted(tokenizer.hf.all_special_tokens))
        markers = ""
        # A template that cannot render this conversation has no markers to add; the special
        # tokens and the text still tell two vocabularies apart.
        with contextlib.suppress(Exception):
            markers = tokenizer.apply_chat_template(
                [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
                tokenize=False,
            )
        text = PROBE_TEXT + specials + "\n" + markers
        return cls(text, list(tokenizer.encode(text, add_special_tokens=False)))

    def difference(self, engine_ids: list[int]) -> str | None:
        """Why the engine's ids for the probe text are not this server's (None: the same)."""
        if engine_ids == self.token_ids:
            return None
        at = next(
            (i for i, (a, b) in enumerate(zip(engine_ids, self.token_ids, strict=False)) if a != b),
            min(len(engine_ids), len(self.token_ids)),
        )
        engine_id = engine_ids[at] if at < len(engine_ids) else "end"
        own_id = self.token_ids[at] if at < len(self.token_ids) else "end"
        return (
            f"mismatch: the engine's tokenizer gives {len(engine_ids)} ids for the probe text, "
            f"this server's {len(self.token_ids)}, first different at {at} (engine {engine_id}, "
            f"server {own_id}); serve the engine's model and revision as the session "
            "server's tokenizer"
        )

    async def compare(
        self, http: httpx.AsyncClient, url: str, timeout: httpx.Timeout
    ) -> str | None:
        """Probe the engine at `url`: None where it tokenizes as this server does (or has no
        tokenize endpoint to ask), else why not (`UNCHECKED` where it did not answer)."""
        try:
            response = await http.post(
                url + PROBE_PATH,
                # No "model": vLLM answers a name it does not serve with a 404, which would
                # read as "no tokenize endpoint"; both engines default to the one they serve.
                json={"prompt": self.text, "add_special_tokens": False},
                timeout=timeout,
            )
        except httpx.HTTPError as exc:
            logger.warning("engine %s: tokenizer probe failed: %r", url, exc)
            return UNCHECKED
        if response.status_code in NO_TOKENIZE_STATUSES:
            logger.warning(
                "engine %s has no %s (%d): its tokenizer cannot be compared with this server's",
                url,
                PROBE_PATH,
                response.status_code,
            )
            return None
        tokens: Any = None
        with contextlib.suppress(ValueError, AttributeError):
            tokens = response.json().get("tokens")
        if response.status_code != 200 or not isinstance(tokens, list):
            logger.warning(
                "engine %s: tokenizer probe answered %d: %s",
                url,
                response.status_code,
                response.text[:200],
            )
            return UNCHECKED
        return self.difference(tokens)
