"""Prompt tokenization shared by the gateway and the engine model.

Both sides must agree on a prompt's token count and on its prefix blocks, so both load the same
`tokenizer.json` through the `tokenizers` library and render chat messages with the same
template. The default is the small byte-level BPE that ships in `bouncer/data` (built by
scripts/make_tokenizer.py); a model's own tokenizer.json can be configured instead.

The chat template is written once here and mirrored as a Jinja template for real engines
(`data/chat_template.jinja`, which scripts/make_tiny_model.py gives the tiny local vLLM model),
so that model renders chats to the same tokens: vLLM hands a text model's template each
message's content as its text parts joined by newlines, tool-call arguments parsed to objects,
and the request's tools, and the template's `tojson` is json.dumps with ensure_ascii off, as here.
"""

from __future__ import annotations

import json
import pathlib
from array import array
from collections.abc import Iterable
from importlib import resources
from typing import Any

import xxhash
from tokenizers import Tokenizer

from bouncer.core.fleet.blocks import chain_block_hashes
from bouncer.segment_cache import PrefixBlocks, SegmentCache, prefix_keys, segment_key, segments_are_independent

# content parts an engine turns into tokens of its own (an image's patches, an audio clip's
# frames): each is counted as `ModelConfig.media_tokens` and rendered as a marker naming it
MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "audio_url", "input_audio", "video_url", "file",
                         "input_file"})


def default_tokenizer_path() -> pathlib.Path:
    return pathlib.Path(str(resources.files("bouncer") / "data" / "tokenizer.json"))


def content_text(content: Any) -> str:
    """A message's content as a text chat template gets it: a string as it is; a list of parts,
    its text parts one per line, each media part a marker that names it (its digest), so that
    prompts with different images differ."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError("message content must be a string or a list of content parts")
    parts = []
    for part in content:
        if not isinstance(part, dict):
            raise TypeError("each content part must be an object")
        kind = part.get("type")
        if kind == "text":
            parts.append(str(part.get("text", "")))
        elif kind in MEDIA_PARTS:
            parts.append(f"<{kind} {xxhash.xxh3_64_intdigest(json.dumps(part, sort_keys=True).encode()):016x}>")
    return "\n".join(parts)


def media_items(messages: Iterable[dict[str, Any]]) -> int:
    """The media parts (images, audio, video, files) of a chat's messages."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") in MEDIA_PARTS)


def tool_arguments(raw: Any) -> Any:
    """A tool call's arguments as vLLM hands them to a template: a JSON string parsed to its
    object; anything else, or nothing, an empty object."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str) and raw:
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def tool_calls_text(calls: Any) -> str:
    """An assistant message's tool calls as the template writes them: one JSON object a line."""
    if not calls:
        return ""
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise TypeError("tool_calls must be a list of objects, each with a function object")
    return "".join("\n" + json.dumps({"name": c["function"].get("name"), "arguments": tool_arguments(
        c["function"].get("arguments"))}, ensure_ascii=False) for c in calls)


CHAT_MARKERS = ("<s>", "</s>")  # what the template brackets each message with
GENERATION_PROMPT = "<s>assistant\n"


def chat_segments(messages: Iterable[dict[str, Any]], tools: list | None = None) -> list[str]:
    """The rendered chat, one string a message (the tools first, where there are any), then the
    generation prompt: everything the engine reads, tool definitions and calls included."""
    out = [f"<s>tools\n{json.dumps(tools, ensure_ascii=False)}</s>\n"] if tools else []
    out += [f"<s>{m.get('role', 'user')}\n{content_text(m.get('content'))}{tool_calls_text(m.get('tool_calls'))}"
            f"</s>\n" for m in messages]
    out.append(GENERATION_PROMPT)
    return out


def render_chat(messages: Iterable[dict[str, Any]], tools: list | None = None) -> str:
    return "".join(chat_segments(messages, tools))


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

    def encode_chat(self, messages: list[dict[str, Any]], tools: list | None = None) -> list[int] | array:
        segments = chat_segments(messages, tools)
        if self.segments is None:
            return self.encode("".join(segments))
        return self._cached_ids(segments, [segment_key(s) for s in segments])[0]

    def encode_chat_blocks(self, messages: list[dict[str, Any]], block_size: int,
                           tools: list | None = None) -> tuple[list[int] | array, list[int]]:
        """The chat's token ids and the chained digests of their full blocks, both exactly those
        of `encode_chat` and `chain_block_hashes`; with the caches, a conversation's next step
        tokenizes only its new messages and hashes only the blocks after its known prefix."""
        segments = chat_segments(messages, tools)
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
