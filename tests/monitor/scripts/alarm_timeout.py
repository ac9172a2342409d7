"""A script that uses SIGALRM itself, as scripts do for timeouts: it sets a handler while
training (or, with --before-torch, before it imports torch) and, ten steps later, a 0.2 s timer;
it counts how often its handler ran and prints "alarm_timeout: fired N": once, whatever the
profiler's own timer did.
"""

import signal
import sys
import time

fired = []


def on_alarm(signum, frame):
    fired.append(time.perf_counter())


if "--before-torch" in sys.argv:
    signal.signal(signal.SIGALRM, on_alarm)

import torch  # noqa: E402  (the recorder starts here)
from torch import nn  # noqa: E402


def main():
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    signal.signal(signal.SIGALRM, on_alarm)  # the handler first; its timer a few steps later
    for step in range(40):
        if step == 10:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
        loss = model(torch.randn(16, 8)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(0.01)
    print(f"alarm_timeout: fired {len(fired)}")


if __name__ == "__main__":
    main()
