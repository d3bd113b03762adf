"""The speculation methods, named once: job requests, the engine's config and its per-request params all use
this enum (the wire values are its string values)."""

import enum


class SpeculativeMethod(enum.StrEnum):
    NONE = "none"  # plain decoding of the target
    DRAFT = "draft"  # a separate draft model proposes (chains, or token trees when tree_size > 0)
    NGRAM = "ngram"  # prompt lookup: the continuation of the longest matching n-gram of the sequence so far
    EAGLE = "eagle"  # an EAGLE-style head over the target's features proposes (chains, or trees when tree_size > 0)
