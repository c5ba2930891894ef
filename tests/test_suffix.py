"""The suffix source (draftwise.suffix): closed-form lookups and votes, its cap, its scopes,
its cache file, and the drafter's copy in progress."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from draftwise.config import MAX_BLOCK, GenerationConfig, SuffixConfig
from draftwise.events import SUFFIX
from draftwise.lm import drive
from draftwise.suffix import SEPARATOR, SuffixIndex, SuffixStore, suffix_keys


def index(*docs: list[int], orders: tuple[int, ...] = (2, 4), occurrences: int = 32) -> SuffixIndex:
    found = SuffixIndex(orders, occurrences)
    for doc in docs:
        keep(found, doc)
    return found


def keep(found: SuffixIndex, doc: list[int]) -> None:
    found.add(doc, suffix_keys(doc, found.orders))


def block(found: SuffixIndex, context: list[int], limit: int = MAX_BLOCK) -> list[int]:
    match = found.match(context)
    return found.continuation(match, limit) if match is not None else []


def test_the_docstring_example() -> None:
    found = index([7, 1, 2, 3, 4], [9, 1, 2, 3, 5])
    assert block(found, [6, 2, 3]) == []  # "2 3" went on with 4 and with 5: no majority
    assert block(found, [8, 1, 2]) == [3]
    keep(found, [1, 2, 3, 4, 6])
    assert block(found, [8, 1, 2]) == [3, 4]


def test_the_longest_match_wins_over_a_more_frequent_short_one() -> None:
    # "5 6" went on with 9 twice; the 4-token "1 2 5 6" went on with 7 once.
    found = index([1, 2, 5, 6, 7, 8], [3, 5, 6, 9], [4, 5, 6, 9])
    assert found.match([0, 1, 2, 5, 6]).order == 4  # type: ignore[union-attr]
    assert block(found, [0, 1, 2, 5, 6]) == [7, 8]
    assert block(found, [0, 4, 4, 5, 6]) == [9]


def test_a_continuation_stops_at_the_end_of_its_output_and_at_the_limit() -> None:
    found = index([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7])
    assert block(found, [1, 2, 3]) == [4, 5]  # one of two ends after 5: no majority for 6
    assert block(found, [1, 2, 3], limit=1) == [4]
    assert block(index([1, 2, 3]), [1, 2, 3]) == []  # the last token of an output leads nowhere


def _voted(found: SuffixIndex, ends: tuple[int, ...], limit: int) -> list[int]:
    """The continuation voted one position at a time (what ``continuation`` computes faster)."""
    tokens = found.documents_tokens()
    flat = [t for doc in tokens for t in [*doc, SEPARATOR]]
    alive, drafted = list(ends), []
    for step in range(1, limit + 1):
        nexts = [flat[e + step - found._base] for e in alive]
        token = max(set(nexts), key=lambda t: (nexts.count(t), t != SEPARATOR))
        if token == SEPARATOR or 2 * nexts.count(token) <= len(alive):
            break
        alive = [e for e, t in zip(alive, nexts) if t == token]
        drafted.append(token)
    return drafted


def test_the_continuation_is_a_vote_position_by_position() -> None:
    rng = random.Random(0)
    for _ in range(200):
        docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(rng.randrange(1, 6))]
        found = index(*docs, orders=(1, 2))
        context = [rng.randrange(4) for _ in range(3)]
        match = found.match(context)
        if match is not None:
            limit = rng.randrange(1, 10)
            assert found.continuation(match, limit) == _voted(found, match.ends, limit)


def test_no_match_and_short_contexts() -> None:
    found = index([1, 2, 3, 4])
    assert found.match([9, 9]) is None
    assert found.match([2]) is None  # shorter than the shortest order
    assert block(found, [1, 2]) == [3, 4]


def test_hash_collisions_are_checked_against_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    honest = block(index([1, 2, 3, 4]), [1, 2])
    # Every suffix hashes alike: only the tokens can tell them apart.
    monkeypatch.setattr("draftwise.suffix.hash", lambda value: 0, raising=False)
    colliding = index([1, 2, 3, 4])
    assert colliding.match([7, 8]) is None
    assert block(colliding, [1, 2]) == [3, 4] == honest


def test_occurrences_keep_only_the_latest() -> None:
    found = index([1, 2, 5], [1, 2, 5], [1, 2, 6], occurrences=1)
    assert block(found, [1, 2]) == [6]


def test_eviction_frees_the_oldest_and_its_index_entries() -> None:
    found = index([1, 2, 3], [4, 5, 6])
    assert found.evict_oldest() == 4
    assert found.size == 4 and found.documents == 1
    assert found.match([1, 2]) is None
    assert block(found, [4, 5]) == [6]
    assert found.documents_tokens() == [[4, 5, 6]]
    found.evict_oldest()
    assert found.size == 0 and all(not table for table in found._ends.values())


def store(**settings: object) -> SuffixStore:
    return SuffixStore(SuffixConfig(lead_tokens=0, **settings))  # type: ignore[arg-type]


def test_the_store_stays_under_its_cap_evicting_the_oldest_across_scopes() -> None:
    kept = store(cap_tokens=10, scope="key")
    a, b = kept.scope("alice"), kept.scope("bob")
    assert a is not None and b is not None and a != b
    kept.add(a, [], [1, 2, 3, 4])  # 5 with the separator
    kept.add(b, [], [5, 6, 7, 8])
    assert kept.size == 10 and kept.documents == 2
    kept.add(a, [], [1, 2, 9])
    assert kept.size == 9 and kept.documents == 2  # bob's stays, alice's first went
    assert kept.draft(a, [1, 2], 8) == (2, [9])
    assert kept.draft(b, [5, 6], 8) == (2, [7, 8])
    kept.add(b, [], list(range(100, 130)))  # longer than the cap: its last tokens, alone
    assert kept.size <= 10 and kept.documents == 1
    assert kept.draft(b, [126, 127], 8) == (2, [128, 129])


def test_scopes_keep_tenants_apart() -> None:
    assert store(scope="none").scope("alice") is None
    assert store(cap_tokens=0).scope("alice") is None
    shared = store(scope="global")
    assert shared.scope("alice") == shared.scope("bob") == shared.scope(None)
    by_key = store(scope="key")
    alice = by_key.scope("alice")
    assert alice is not None and "alice" not in alice  # a digest, never the key itself
    by_key.add(alice, [], [1, 2, 3])
    assert by_key.draft(alice, [1, 2], 4) == (2, [3])
    assert by_key.draft(by_key.scope("bob") or "", [1, 2], 4) == (0, [])
    assert by_key.draft(by_key.scope(None) or "", [1, 2], 4) == (0, [])


def test_lead_tokens_let_an_answer_open_from_the_prompts_end() -> None:
    kept = SuffixStore(SuffixConfig(lead_tokens=2))
    kept.add("", [50, 51, 8, 9], [1, 2, 3])
    assert kept.draft("", [60, 61, 8, 9], 8) == (2, [1, 2, 3])
    with_prompts = SuffixStore(SuffixConfig(lead_tokens=0, prompts=True))
    with_prompts.add("", [70, 71, 72], [1])
    assert with_prompts.draft("", [70, 71], 8) == (2, [72])


def test_the_cache_round_trips_and_refuses_another_vocabulary(tmp_path: Path) -> None:
    path = tmp_path / "suffix.json"
    kept = store()
    kept.add("", [], [1, 2, 3])
    kept.add(kept.scope("alice") or "", [], [4, 5, 6])
    kept.save(path, "vocab-a")
    again = store()
    assert again.load(path, "vocab-a") is None
    assert again.size == kept.size and again.draft("", [1, 2], 4) == (2, [3])
    other = store()
    assert "another model" in (other.load(path, "vocab-b") or "") and other.size == 0
    path.write_text("{not json")
    assert "unreadable" in (other.load(path, "vocab-a") or "") and other.size == 0
    path.write_text(json.dumps({"format": "draftwise-suffix-cache/1", "vocabulary": "vocab-a", "documents": [[1]]}))
    assert "unreadable" in (other.load(path, "vocab-a") or "") and other.size == 0
    assert store().load(tmp_path / "absent.json", "vocab-a") is None


def test_adding_while_drafting_from_other_threads() -> None:
    kept = store(cap_tokens=200)
    stop = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                order, drafted = kept.draft("", [1, 2], 16)
                assert order in (0, 2) and SEPARATOR not in drafted
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers:
        thread.start()
    for i in range(300):
        kept.add("", [], [1, 2, 3, i % 7, 4])
    stop.set()
    for thread in readers:
        thread.join()
    assert not errors and kept.size <= 200


def test_the_drafter_copies_on_without_a_new_lookup_and_keys_its_offers() -> None:
    kept = store(max_match=4)
    kept.add("", [], [5, 6, 1, 2, 3, 4, 10, 11, 12, 13])
    drafter = kept.drafter("")
    drafter.start([9], GenerationConfig(), None)
    (offer,) = drafter.offers([9, 5, 6])
    assert offer.source == SUFFIX and offer.key == f"{SUFFIX}:2" and not offer.grounded
    assert offer.limit == 8
    assert drive(drafter.propose([9, 5, 6], 3)).tokens.tolist() == [1, 2, 3]
    # Two kept and a correction that is the block's own next token: still following it, on
    # a match of 5 tokens now, past the longest looked up (4): grounded.
    (offer,) = drafter.offers([9, 5, 6, 1, 2, 3])
    assert offer.key == f"{SUFFIX}:copy" and offer.grounded and offer.limit == 5
    assert drive(drafter.propose([9, 5, 6, 1, 2, 3], 2)).tokens.tolist() == [4, 10]
    # A copy on a shorter match is not grounded.
    short = kept.drafter("")
    short.start([9], GenerationConfig(), None)
    short.offers([9, 5, 6])
    (offer,) = short.offers([9, 5, 6, 1])
    assert offer.key == f"{SUFFIX}:copy" and not offer.grounded
    # The output left it: a fresh lookup.
    assert drafter.offers([9, 5, 6, 1, 2, 3, 0]) == ()
    assert drive(drafter.propose([9, 5, 6, 1, 2, 3, 0], 2)).tokens.tolist() == []
