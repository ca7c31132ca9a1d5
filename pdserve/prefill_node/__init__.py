from pdserve.common.node import NodeBase as PrefillNode  # placeholder until written
