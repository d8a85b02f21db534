"""The math verifier: final-answer extraction, number and fraction normalisation (it measures only)."""

from __future__ import annotations

import pytest

from pivotrl.tasks.verifiers import exact_equal, extract_answer, math_equal, to_number


@pytest.mark.parametrize(
    ("response", "reference", "want"),
    [
        ("so the total is \\boxed{19}", "19", True),
        ("\\boxed{\\frac{3}{4}}", "0.75", True),
        ("\\boxed{\\dfrac{1}{2}} though maybe 7", "1/2", True),  # the box wins over a later number
        ("\\boxed{{1}+{2}}", "{1}+{2}", True),  # nested braces
        ("answer: 19", "19", True),
        ("The answer is 42 apples.", "42", True),
        ("Final answer: $1,000.", "1000", True),
        ("12 + 7 = 19. answer: 19", "Tom ... #### 19", True),  # GSM8K-style reference
        ("first 5, then 7", "7", True),  # the last number
        ("2/4", "1/2", True),
        ("-3.50", "-7/2", True),
        ("answer: 0.5", "1/2", True),
        ("answer: Paris", "paris", True),  # not a number: text, case and spaces ignored
        ("\\boxed{x + 1}", "x+1", True),
        ("answer: 18", "19", False),
        ("\\boxed{x+1}", "1", False),  # not the 1 inside an expression
        ("no number here", "3", False),
        ("", "3", False),
        ("19.5", "19", False),
        ("1,2,3", "123", False),  # a list is not a thousands separator
    ],
)
def test_math_verifier(response, reference, want):
    assert math_equal(response, reference) is want


def test_extraction_and_numbers():
    assert extract_answer("nothing") is None and extract_answer(None) is None  # type: ignore[arg-type]
    assert extract_answer("a 3 b 4") == "4" and extract_answer("#### 72") == "72"
    assert to_number("1,234.5") == to_number("2469/2") and to_number("x") is None and to_number("1/0") is None


def test_exact_verifier_normalises_whitespace_only():
    assert exact_equal(" a  b ", "a b") and not exact_equal("A b", "a b")
