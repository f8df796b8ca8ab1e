"""Hypothesis strategies for values someone else wrote: wrong types, huge numbers, escapes, nesting."""

from __future__ import annotations

from hypothesis import strategies as st

hostile_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([10**9, 10**7, -5, 0, 2**63, 10**4000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["twenty", "\x1b[31mred\x1b[0m", "../../etc", "32", "", "a\nb"]),
)
hostile_values = st.recursive(
    hostile_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8,
)
