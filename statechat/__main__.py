"""`python -m statechat ...`: the same commands as the `statechat` script (statechat/cli.py),
for an environment whose scripts folder is not on PATH."""

from statechat.cli import main

if __name__ == "__main__":
    main()
