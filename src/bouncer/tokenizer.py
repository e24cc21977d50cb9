"""Prompt tokenization shared by the gateway and the engine model.

Both sides must agree on a prompt's token count and on its prefix blocks, so both load the same
`tokenizer.json` through the `tokenizers` library and render chat messages with the same
template. The default is the small byte-level BPE that ships in `bouncer/data` (built by
scripts/make_tokenizer.py); a model's own tokenizer.json can be configured instead.

The chat template is written once here and mirrored as a Jinja template for real engines
(`CHAT_TEMPLATE_JINJA`), so a tiny local vLLM model renders chats to the same tokens.
"""

from __future__ import annotations

import json
import pathlib
from array import array
from collections.abc import Iterable
from importlib import resources
from typing import Any

from tokenizers import Tokenizer

from bouncer.core.fleet.blocks import chain_block_hashes
from bouncer.segment_cache import PrefixBlocks, SegmentCache, prefix_keys, segment_key, segments_are_independent

CHAT_TEMPLATE_JINJA = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def default_tokenizer_path() -> pathlib.Path:
    return pathlib.Path(str(resources.files("bouncer") / "data" / "tokenizer.json"))


def message_text(content: Any) -> str:
    """OpenAI message content: a string, or a list of parts of which text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise TypeError("message content must be a string or a list of content parts")


CHAT_MARKERS = ("<s>", "</s>")  # what the template brackets each message with
GENERATION_PROMPT = "<s>assistant\n"


def chat_segments(messages: Iterable[dict[str, Any]]) -> list[str]:
    """The rendered chat, one string a message, then the generation prompt."""
    out = [f"<s>{m.get('role', 'user')}\n{message_text(m.get('content'))}</s>\n" for m in messages]
    out.append(GENERATION_PROMPT)
    return out


def render_chat(messages: Iterable[dict[str, Any]]) -> str:
    return "".join(chat_segments(messages))


class PromptTokenizer:
    """`segment_cache`: cache each chat message's tokens (`bouncer.segment_cache`), where this
    tokenizer allows it exactly; `segment_cache_tokens` bounds it."""

    def __init__(self, path: str | pathlib.Path | None = None, segment_cache: bool = True,
                 segment_cache_tokens: int | None = None) -> None:
        self.path = pathlib.Path(path) if path else default_tokenizer_path()
        try:
            self._tok = Tokenizer.from_file(str(self.path))
            spec = json.loads(self.path.read_text())
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"cannot load tokenizer {self.path}: {exc}") from exc
        self.segments: SegmentCache | None = None
        self.prefix_blocks: PrefixBlocks | None = None
        if segment_cache and segments_are_independent(spec, CHAT_MARKERS):
            self.segments = SegmentCache() if segment_cache_tokens is None else SegmentCache(segment_cache_tokens)
            self.prefix_blocks = PrefixBlocks()
        self.vocab_size = self._tok.get_vocab_size()
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        # Texts of ordinary tokens, for producing output text one token at a time.
        self._texts = [self._tok.decode([i]) for i in range(self.vocab_size)]
        # Each token covers at most this many bytes of the text it was encoded from, so a text of
        # n bytes has at least n / max_token_bytes tokens: where nothing rewrites the text first
        # (a normalizer) and no token stands for text of any length (an unknown-word token).
        # Tokens of a partial UTF-8 sequence decode to U+FFFD, longer than their byte: the safe side.
        model = spec.get("model") or {}
        self.max_token_bytes: int | None = None
        if spec.get("normalizer") is None and not model.get("unk_token"):
            self.max_token_bytes = max([len(t.encode()) for t in self._texts] + [len(s.encode()) for s in specials]
                                       + [1])
        self.output_token_ids = [i for i in range(self.vocab_size)
                                 if self._tok.id_to_token(i) not in specials and self._texts[i].strip()
                                 and "\ufffd" not in self._texts[i]]

    def encode(self, text: str) -> list[int]:
        # the batch "fast" path skips offsets we never read: ~10-25% cheaper per call
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int] | array:
        segments = chat_segments(messages)
        if self.segments is None:
            return self.encode("".join(segments))
        return self._cached_ids(segments, [segment_key(s) for s in segments])[0]

    def encode_chat_blocks(self, messages: list[dict[str, Any]], block_size: int) -> tuple[list[int] | array,
                                                                                          list[int]]:
        """The chat's token ids and the chained digests of their full blocks, both exactly those
        of `encode_chat` and `chain_block_hashes`; with the caches, a conversation's next step
        tokenizes only its new messages and hashes only the blocks after its known prefix."""
        segments = chat_segments(messages)
        if self.segments is None or self.prefix_blocks is None:
            ids = self.encode("".join(segments))
            return ids, chain_block_hashes(ids, block_size)
        keys = [segment_key(s) for s in segments]
        ids, ends = self._cached_ids(segments, keys)
        rolling = prefix_keys(keys)
        known, digests = 0, array("Q")
        for k in range(len(segments) - 2, -1, -1):  # the longest prefix seen before
            found = self.prefix_blocks.get(rolling[k], block_size)
            if found is not None and found[0] == ends[k]:
                known, digests = found[0] // block_size, array("Q", found[1])
                break
        parent = digests[-1] if known else 0
        digests.extend(chain_block_hashes(ids[known * block_size:], block_size, parent))
        # what the next step will start with: all but the generation prompt
        prefix_end = ends[-2] if len(ends) > 1 else 0
        if prefix_end:
            self.prefix_blocks.put(rolling[-2], block_size, prefix_end, digests[:prefix_end // block_size])
        return ids, digests.tolist()

    def _cached_ids(self, segments: list[str], keys: list[int]) -> tuple[array, list[int]]:
        """The segments' ids, joined, from the cache where it has them; and where each segment
        ends in them."""
        cache = self.segments
        parts = [cache.get(k) for k in keys]
        missing = [i for i, ids in enumerate(parts) if ids is None]
        if missing:
            # one call for all of them: the library spreads a batch over its threads
            encodings = self._tok.encode_batch_fast([segments[i] for i in missing], add_special_tokens=False)
            for i, enc in zip(missing, encodings, strict=True):
                parts[i] = ids = array("I", enc.ids)
                cache.put(keys[i], ids)
        out = array("I")
        ends = []
        for ids in parts:
            out.extend(ids)  # type: ignore[arg-type]
            ends.append(len(out))
        return out, ends

    def token_text(self, token_id: int) -> str:
        return self._texts[token_id]
