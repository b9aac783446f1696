"""gemcore collective layer (see issue 5): one Communicator API over several backends."""
