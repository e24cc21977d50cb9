"""The chat-segment token cache is exact: cached or not, a prompt's token ids, count and block
digests are those of tokenizing the whole rendered chat, on conversations built to break it."""

from __future__ import annotations

import json
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from bouncer.core.fleet.blocks import chain_block_hashes, prompt_digest
from bouncer.segment_cache import SegmentCache, segments_are_independent
from bouncer.tokenizer import CHAT_MARKERS, PromptTokenizer, default_tokenizer_path, render_chat

FULL = PromptTokenizer(segment_cache=False)
TRICKY = ["<s>", "</s>", "<unk>", "<pad>", "\n", "\n\n", " ", "  ", "\t", "é", "日本語", "🙂", "s>", "</", "<s",
          "assistant\n", "user", "  leading", "trailing  ", "a" * 300, "\r\n", "\u200b"]
text = st.lists(st.one_of(st.sampled_from(TRICKY), st.text(max_size=40)), max_size=12).map("".join)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "a b"]),
                                 "content": text})


def _full(messages):
    return FULL.encode(render_chat(messages))


@settings(max_examples=300, deadline=None)
@given(st.lists(message, min_size=1, max_size=8), st.lists(message, min_size=1, max_size=4))
def test_cached_tokens_are_exactly_a_full_tokenization(history, new):
    tok = PromptTokenizer()
    assert tok.segments is not None
    first = tok.encode_chat(history)  # cold
    assert list(first) == _full(history)
    grown = history + new  # the next step: the same history, more messages; mostly cache hits
    ids = tok.encode_chat(grown)
    full = _full(grown)
    assert list(ids) == full
    assert chain_block_hashes(ids, 16) == chain_block_hashes(full, 16)
    assert prompt_digest(ids) == prompt_digest(full)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(message, min_size=1, max_size=3), min_size=1, max_size=5), st.sampled_from([1, 4, 16]))
def test_block_digests_of_a_growing_conversation_are_exactly_a_full_hashing(steps, block_size):
    tok = PromptTokenizer()
    messages: list[dict] = []
    for new in steps:  # each step sends the conversation so far and more
        messages = messages + new
        ids, digests = tok.encode_chat_blocks(messages, block_size)
        full = _full(messages)
        assert list(ids) == full and digests == chain_block_hashes(full, block_size)


def test_a_branch_of_a_conversation_reuses_only_the_prefix_they_share():
    tok = PromptTokenizer()
    base = [{"role": "system", "content": "shared context " * 500}, {"role": "user", "content": "first " * 300}]
    tok.encode_chat_blocks(base, 16)
    for branch in ("left", "right"):  # two continuations of the same prefix, then one that edits it
        messages = base + [{"role": "assistant", "content": f"{branch} " * 200}]
        assert tok.encode_chat_blocks(messages, 16)[1] == chain_block_hashes(_full(messages), 16)
    edited = [base[0], {"role": "user", "content": "edited " * 300}]
    assert tok.encode_chat_blocks(edited, 16)[1] == chain_block_hashes(_full(edited), 16)


def test_an_agent_session_tokenizes_only_what_is_new():
    tok = PromptTokenizer()
    messages = [{"role": "system", "content": "You are a careful coding agent. " * 200}]
    for step in range(12):
        messages += [{"role": "user", "content": f"step {step}: run the tests and read the failures " * 50},
                     {"role": "assistant", "content": f"tool output {step}: " + "FAILED test_x " * 80}]
        misses = tok.segments.misses
        assert list(tok.encode_chat(messages)) == _full(messages)
        # the two new messages and the generation prompt (seen once, then cached) at most
        assert tok.segments.misses - misses <= 3 if step else True
    assert tok.segments.hits >= 2 * 11


def test_the_cache_stays_within_its_bounds():
    tok = PromptTokenizer(segment_cache_tokens=500)
    for i in range(50):
        tok.encode_chat([{"role": "user", "content": f"message {i} " * 20}])
        assert tok.segments.tokens <= 500
    assert len(tok.segments) < 50
    cache = SegmentCache(max_tokens=10**6, max_entries=3)
    from array import array
    for k in range(10):
        cache.put(k, array("I", [k]))
    assert len(cache) == 3 and cache.get(9) is not None and cache.get(0) is None


def test_tokenizers_it_cannot_be_exact_for_tokenize_whole(tmp_path):
    spec = json.loads(default_tokenizer_path().read_text())
    assert segments_are_independent(spec, CHAT_MARKERS)
    unmarked = dict(spec, added_tokens=[dict(t, special=False) for t in spec["added_tokens"]])
    normalized = dict(spec, normalizer={"type": "NFC"})
    metaspace = dict(spec, pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"})
    for other in (unmarked, normalized, metaspace):
        assert not segments_are_independent(other, CHAT_MARKERS)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(normalized))
    tok = PromptTokenizer(path)
    messages = [{"role": "user", "content": "café"}]
    assert tok.segments is None and tok.encode_chat(messages) == PromptTokenizer(path, segment_cache=False).encode(
        render_chat(messages))


def test_threads_sharing_one_cache_get_their_own_prompts():
    tok = PromptTokenizer(segment_cache_tokens=2_000)  # small: evictions happen while they run
    convs = [[{"role": "user", "content": f"thread {i} turn {j} " * (5 + j)} for j in range(6)] for i in range(8)]
    wrong = []

    def run(conv):
        for n in range(1, len(conv) + 1):
            for _ in range(5):
                if list(tok.encode_chat(conv[:n])) != _full(conv[:n]):
                    wrong.append(conv[0]["content"][:10])
    threads = [threading.Thread(target=run, args=(c,)) for c in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
