"""Command-line options of the test suite."""


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=None,
                     help="Cases of tests/test_fuzz.py to run [default: $PITOOLS_FUZZ_CASES, else 400].")
