"""`python -m unshard` and the `unshard` console script: the same CLI as the Rust binary."""

import sys


def main() -> None:
    from ._unshard import run_cli

    # The CLI parses its own arguments (argv[0] is its name in messages) and returns
    # the exit code the Rust binary would: 0 success, 1 failure, 2 usage.
    code = run_cli(["unshard", *sys.argv[1:]])
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
