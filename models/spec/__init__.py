"""The SemanticSpec algorithm, on any LM (``semspec.models.lm``): ``rules`` (the acceptance rule, one pure
function), ``settings`` (``DecodeSettings``, every decode setting defined once), ``results`` (what a
decoder returns), ``batching`` and ``draft_target`` (the batched step loop), the methods
(``semanticspec``, ``specreason``, ``token_level``), and beside them ``probe``, ``judges``, ``grading``,
``steps`` and ``names`` (the vocabulary)."""
