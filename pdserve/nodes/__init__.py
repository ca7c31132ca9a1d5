"""The node roles: the loop every node runs (base.py) and what each role adds to it (prefill, decode, colocated).
`pdserve prefill|decode|colocated` (or `python -m pdserve prefill|decode|colocated`) runs one."""
