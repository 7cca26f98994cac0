// Failures: a peer killed mid-transfer, abort() from another thread, bad input.
#include "tests/integration/fabric/world.h"
