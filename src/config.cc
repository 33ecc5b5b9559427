#include "strata/config.h"
