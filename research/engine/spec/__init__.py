"""Speculative decoding, in one place: propose, verify, roll back.

- **Propose** (``speculator.propose``, before a step is scheduled): every caught-up running
  sequence asks the proposer for up to k drafts: prompt lookup (``ngram.NgramProposer``, host)
  or a smaller model with the target's vocabulary (``draft.DraftModelProposer``, its own paged
  pool and shadow sequences).
- **Verify** (in the step's one forward pass, ``research.engine.step``): a sequence with drafts
  is a row of its last token and the drafts; every position is scored, and
  ``rejection.rejection_sample`` accepts or rejects the drafts on device so the output
  distribution is exactly the target's.
- **Roll back** (``speculator.rollback``, at commit): the accepted drafts and the sampled token
  are appended; the rejected drafts' slots are released where the rollback crosses a block
  boundary (the next step overwrites the rest), and ``SpecStats`` counts it all.
"""

from research.engine.spec.speculator import SpecStats, make_proposer, propose, rollback

__all__ = ["SpecStats", "make_proposer", "propose", "rollback"]
