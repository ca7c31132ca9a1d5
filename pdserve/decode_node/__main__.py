import sys

from pdserve.cli import main

main(["decode", *sys.argv[1:]])
