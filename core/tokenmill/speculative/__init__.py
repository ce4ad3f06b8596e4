"""Speculative decoding, in one package: the speculator interface (``speculator``), the proposer that asks it
for drafts after each step and hands them to the scheduler (``proposer``), the draft policy that decides how
many drafts pay (``draft_policy``), draft trees (``draft_tree``), and the verification of drafts against the
target (``verification``, ``rejection_sampler``). docs/speculative_decoding.md tells the whole story.

Importing the package imports none of its modules: ``tokenmill.config`` reads ``draft_tree`` without the rest.
"""
