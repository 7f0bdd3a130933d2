"""Speculative decoding: proposers guess a sequence's next tokens cheaply, the model verifies
them all in one forward (see kvloop.sampling.rejection), and every accepted guess is a
decode step saved.

A proposer maps token ids to draft token ids and knows nothing of requests; the engine
decides who speculates and how far. NgramProposer is pure lookup; DraftModelProposer
(kvloop.spec.draft) runs a smaller model with its own KV cache.
"""

from __future__ import annotations

from kvloop.spec.ngram import NgramProposer
from kvloop.spec.proposer import DraftRequest, Proposer

__all__ = ["DraftRequest", "NgramProposer", "Proposer"]
