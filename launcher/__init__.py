"""Starting and supervising the fleet's processes on one machine."""
