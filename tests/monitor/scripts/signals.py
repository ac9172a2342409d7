"""Planted: a script with its own SIGINT cleanup, a DataLoader worker and a child process.

With --steps N it trains N steps and ends normally. Writes its pid and its children's pids to the file given as argv[1], then trains until stopped;
after 20 steps it creates argv[1] + ".trained".
On KeyboardInterrupt it prints "signals: cleanup ran" and exits with 130; with --ignore-sigint
it ignores SIGINT altogether. With --child-ends-the-script, its child process, terminated, ends the
script at once (SIGKILL): a script that goes down with its children, as one with a DataLoader does
when a worker is killed (its SIGCHLD handler raises), but without a race. With --chain-sigterm it
stops training on SIGTERM with a handler of its own that calls the one it replaced, as
Lightning's does, and ends normally, printing "signals: stopped by its own handler".
"""

import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Forever(Dataset):
    def __len__(self):
        return 10**9

    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.randn(8)


TRAINED_MARK = 20
"""After this many steps the script says so (PIDS_FILE.trained)."""


def idle(ends_the_script: bool):
    if ends_the_script:
        import os
        import signal

        def end_the_script(signum, frame):
            os.kill(os.getppid(), signal.SIGKILL)
            os._exit(143)

        signal.signal(signal.SIGTERM, end_the_script)
    time.sleep(600)


def main():
    torch.set_num_threads(1)
    if "--ignore-sigint" in sys.argv:  # a script that will not stop on Ctrl-C
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = mp.get_context("fork").Process(target=idle, args=("--child-ends-the-script" in sys.argv,), daemon=False)
    child.start()
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = iter(DataLoader(Forever(), batch_size=4, num_workers=1))
    import os
    import psutil
    X = next(loader)
    pids = [os.getpid()] + [c.pid for c in psutil.Process().children(recursive=True)]
    with open(sys.argv[1], "w") as f:
        f.write(" ".join(map(str, pids)))
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else None
    done = 0
    stopping = []
    if "--chain-sigterm" in sys.argv:
        import signal

        replaced = signal.getsignal(signal.SIGTERM)

        def stop(signum, frame):
            stopping.append(signum)
            if callable(replaced):
                replaced(signum, frame)

        signal.signal(signal.SIGTERM, stop)
    try:
        while (steps is None or steps > 0) and not stopping:
            steps = steps - 1 if steps is not None else None
            loss = model(X).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            X = next(loader)
            done += 1
            if done == TRAINED_MARK:  # a test waits for this rather than for a guessed time
                open(sys.argv[1] + ".trained", "w").close()
    except KeyboardInterrupt:
        print("signals: cleanup ran", flush=True)
        child.terminate()
        sys.exit(130)
    if stopping:
        print("signals: stopped by its own handler", flush=True)
    child.terminate()


if __name__ == "__main__":
    main()
