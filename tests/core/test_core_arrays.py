"""gockpt.core.arrays: validation of the numpy arrays handed to the C++ core."""

from __future__ import annotations

import numpy as np
import pytest

from gockpt.core.arrays import check_non_negative, int64_arrays


def test_int64_arrays_gives_contiguous_int64_of_one_length():
    a = np.arange(6, dtype=np.int32)[::2]  # not contiguous, not int64
    b = [7, 8, 9]
    c = np.array([1, 2, 3], dtype=np.uint16)
    out = int64_arrays(("a", a), ("b", b), ("c", c))
    assert [x.tolist() for x in out] == [[0, 2, 4], [7, 8, 9], [1, 2, 3]]
    assert all(x.dtype == np.int64 and x.flags.c_contiguous for x in out)


def test_int64_arrays_keeps_large_addresses_exact():
    addr = np.array([2**48 + 1, 2**62 - 3], dtype=np.int64)
    [out] = int64_arrays(("p", addr))
    assert out.tolist() == [2**48 + 1, 2**62 - 3]


def test_an_empty_array_of_any_dtype_is_taken():
    out = int64_arrays(("p", []), ("m", np.zeros(0, dtype=np.float64)))
    assert [(x.dtype, len(x)) for x in out] == [(np.int64, 0), (np.int64, 0)]


@pytest.mark.parametrize("bad,message", [
    (np.zeros((2, 2), dtype=np.int64), r"q must be a 1-D array, got shape \(2, 2\)"),
    (np.int64(3), r"q must be a 1-D array, got shape \(\)"),
    (np.array([1.0, 2.0]), "q must be an integer array, got dtype float64"),
    (np.array([True, False]), "q must be an integer array, got dtype bool"),
])
def test_int64_arrays_refuses_what_the_cpp_side_would_truncate(bad, message):
    with pytest.raises(ValueError, match=message):
        int64_arrays(("p", np.arange(2)), ("q", bad))


def test_int64_arrays_refuses_lengths_that_differ_naming_the_first():
    with pytest.raises(ValueError, match=r"numel has 3 elements, expected 2 \(as p\)"):
        int64_arrays(("p", [1, 2]), ("numel", [1, 2, 3]))


def test_check_non_negative_names_the_first_negative_element():
    check_non_negative("numel", np.array([0, 5, 7]))
    check_non_negative("numel", np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match=r"numel\[2\] is negative \(-4\)"):
        check_non_negative("numel", np.array([0, 5, -4, -1]))
