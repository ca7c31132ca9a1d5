import sys

from pdserve.cli import main

main(["colocated", *sys.argv[1:]])
