"""Small services every layer may use: progress on stderr, the trace timeline, crash points for tests, SIGINT
and SIGTERM as one exception (signals), and atomic file writes with one wording for write failures. Standard
library only."""
