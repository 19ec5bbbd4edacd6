"""The adaptive batch controller (the article's stage 3): what it sees of an engine, and its control law."""
