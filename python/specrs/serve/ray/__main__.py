"""`python -m specrs.serve.ray ARGS`: the same as `specrs serve --ray ARGS`."""

import sys

from ...cli import main

sys.exit(main(["serve", "--ray", *sys.argv[1:]]))
