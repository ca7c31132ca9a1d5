import sys

from pdserve.cli import main

main(["prefill", *sys.argv[1:]])
