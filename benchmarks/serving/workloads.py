"""The workloads the serving bench replays: prompts as token ids, in the order they are sent.

- ``chats``: users share one system prompt and each holds a conversation of several turns.
  A turn's prompt is the system prompt, every earlier turn (the user's message and the
  reply) and the new message. The replies in the history are fixed tokens of the reply's
  length, not what the model said, so every configuration sees the same prompts. Turns of
  one user are sent one after the other; users run concurrently.
- ``docs``: many questions on a few long documents; a prompt is a document and a question.
  Questions go round-robin over the documents, so the first questions on every document
  arrive together.
- ``unique``: prompts that share nothing, drawn afresh for every pass, so no cache (vLLM's,
  kvfabric's) can ever hit: what remains is what a cache costs when it cannot help.

Every prompt starts with a token of its own workload, so no two workloads share a block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["WORKLOADS", "Request", "Workload", "WorkloadSizes", "build"]

WORKLOADS = ("chats", "docs", "unique")
_FIRST_ID = 3  # 0-2 are special in the random model's config (pad, bos, eos)


@dataclass(frozen=True)
class Request:
    workload: str
    index: int
    prompt: list[int] = field(repr=False)
    max_tokens: int
    group: int
    """The user (chats) or the document (docs); the request's own index for unique."""
    step: int
    """The turn (chats) or the question (docs); 0 for unique."""


@dataclass(frozen=True)
class Workload:
    name: str
    sequences: list[list[Request]]
    """Each sequence is sent in order, one request after the other; sequences run concurrently
    (as many at a time as the bench's concurrency allows)."""

    @property
    def requests(self) -> list[Request]:
        return [r for sequence in self.sequences for r in sequence]


@dataclass(frozen=True)
class WorkloadSizes:
    chat_users: int
    chat_turns: int
    prefix_tokens: int
    user_tokens: int
    output_tokens: int
    docs: int
    doc_tokens: int
    questions: int
    question_tokens: int
    unique: int
    unique_tokens: int

    @property
    def longest_prompt(self) -> int:
        turns = self.chat_turns
        chat = self.prefix_tokens + turns * self.user_tokens + (turns - 1) * self.output_tokens
        return 1 + max(chat, self.doc_tokens + self.question_tokens, self.unique_tokens)


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(_FIRST_ID, vocab) for _ in range(count)]


def build(name: str, sizes: WorkloadSizes, vocab: int, pass_name: str = "") -> Workload:
    """The workload ``name``: the same prompts every time, except ``unique``'s, which
    differ for every ``pass_name`` (and never repeat within one)."""
    rng = random.Random(f"kvfabric-serving-bench/{name}")
    mark = [_FIRST_ID + WORKLOADS.index(name)]
    if name == "chats":
        system = mark + _tokens(rng, sizes.prefix_tokens, vocab)
        users = []
        for user in range(sizes.chat_users):
            history = list(system)
            turns = []
            for turn in range(sizes.chat_turns):
                history += _tokens(rng, sizes.user_tokens, vocab)
                index = user * sizes.chat_turns + turn
                turns.append(Request(name, index, list(history), sizes.output_tokens, user, turn))
                history += _tokens(rng, sizes.output_tokens, vocab)  # the reply, as sent back
            users.append(turns)
        return Workload(name, users)
    if name == "docs":
        docs = [mark + _tokens(rng, sizes.doc_tokens, vocab) for _ in range(sizes.docs)]
        questions = [
            [_tokens(rng, sizes.question_tokens, vocab) for _ in range(sizes.questions)]
            for _ in docs
        ]
        order = [(q, d) for q in range(sizes.questions) for d in range(sizes.docs)]
        return Workload(
            name,
            [
                [Request(name, i, docs[d] + questions[d][q], sizes.output_tokens, d, q)]
                for i, (q, d) in enumerate(order)
            ],
        )
    if name == "unique":
        rng = random.Random(f"kvfabric-serving-bench/unique/{pass_name}")
        return Workload(
            name,
            [
                [
                    Request(
                        name,
                        i,
                        mark + _tokens(rng, sizes.unique_tokens, vocab),
                        sizes.output_tokens,
                        i,
                        0,
                    )
                ]
                for i in range(sizes.unique)
            ],
        )
    raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
