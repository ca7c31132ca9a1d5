from pdserve.common.node import NodeBase as DecodeNode  # placeholder until written
