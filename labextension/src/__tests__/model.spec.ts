import { CedanaModel } from '../model';
import { CedanaAPIError } from '../request';
import { EVENT_SCHEMA_ID, IKernel } from '../types';
import {
  FakeEvents,
  FakeServer,
  FakeSessions,
  makeKernel,
  makeStatus,
  sleep
} from './fakes';

const GB = 1e9;

function gpu(index: number, memory: number, utilization: number | null = 50) {
  return { index, uuid: `GPU-${index}`, memory_bytes: memory, utilization };
}

describe('CedanaModel', () => {
  let server: FakeServer;
  let sessions: FakeSessions;
  let events: FakeEvents;
  let kernels: IKernel[];
  let model: CedanaModel;

  beforeEach(() => {
    kernels = [
      makeKernel({ id: 'k1', gpus: [gpu(0, 2 * GB), gpu(1, 1 * GB)] }),
      makeKernel({
        id: 'k2',
        state: 'suspended',
        tier: 'disk',
        checkpoint_bytes: 3 * GB,
        gpus: [gpu(0, 4 * GB, null)]
      }),
      makeKernel({ id: 'k3' })
    ];
    server = new FakeServer();
    server
      .on('GET', 'kernels', () => ({ body: kernels }))
      .on('GET', 'status', () => ({ body: makeStatus({ bytes_used: GB }) }));
    for (const id of ['k1', 'k2', 'k3']) {
      server.on('GET', `kernels/${id}`, () => {
        const kernel = kernels.find(k => k.id === id);
        return kernel
          ? { body: kernel }
          : { status: 404, body: { code: 'not_found', message: 'gone' } };
      });
    }
    sessions = new FakeSessions();
    events = new FakeEvents();
    model = new CedanaModel({
      serverSettings: server.settings(),
      sessions,
      events,
      autoStart: false,
      debounceDelay: 5,
      transitionalDelay: 10
    });
  });

  afterEach(() => {
    model.dispose();
  });

  it('loads kernels and status', async () => {
    const changed = jest.fn();
    model.changed.connect(changed);
    expect(model.loaded).toBe(false);
    await model.refresh();
    expect(model.loaded).toBe(true);
    expect(model.error).toBeNull();
    expect(model.kernels.map(k => k.id)).toEqual(['k1', 'k2', 'k3']);
    expect(model.status?.criu_version).toBe('4.2.1');
    expect(changed).toHaveBeenCalled();
  });

  it('records a refresh error and recovers', async () => {
    server.on('GET', 'kernels', () => ({
      status: 503,
      body: { code: 'engine_unavailable', message: 'criu is missing' }
    }));
    await model.refresh();
    expect(model.error).toBe('criu is missing');
    server.on('GET', 'kernels', () => ({ body: kernels }));
    await model.refresh();
    expect(model.error).toBeNull();
  });

  it('drops kernels the server no longer has', async () => {
    await model.refresh();
    kernels = kernels.filter(k => k.id !== 'k3');
    await model.refresh();
    expect(model.get('k3')).toBeUndefined();
    expect(model.kernels).toHaveLength(2);
  });

  it('merges notebook paths from the sessions and sorts by them', async () => {
    await model.refresh();
    sessions.add('work/zeta.ipynb', 'k1');
    sessions.add('work/alpha.ipynb', 'k3');
    expect(model.pathOf('k1')).toBe('work/zeta.ipynb');
    expect(model.pathOf('k2')).toBeNull();
    expect(model.kernels.map(k => k.id)).toEqual(['k3', 'k1', 'k2']);
  });

  it('refreshes when the sessions change', async () => {
    await model.refresh();
    const before = server.requests.length;
    sessions.add('new.ipynb', 'k1');
    await sleep(30);
    expect(server.requests.length).toBeGreaterThan(before);
  });

  it('sums the GPU memory freed, the suspended kernels and the disk', async () => {
    await model.refresh();
    const summary = model.summary;
    expect(summary.suspended).toBe(1);
    expect(summary.total).toBe(3);
    expect(summary.gpuMemoryFreed).toBe(4 * GB);
    expect(summary.gpuMemoryInUse).toBe(3 * GB);
    // The larger of the status's bytes_used and the kernels' checkpoints.
    expect(summary.checkpointBytes).toBe(3 * GB);
    expect(model.gpuMemory(model.get('k1')!)).toBe(3 * GB);
  });

  it('remembers the GPU memory a kernel held before it was suspended', async () => {
    await model.refresh();
    kernels[0] = {
      ...kernels[0],
      state: 'suspended',
      tier: 'disk',
      gpus: []
    };
    await model.refresh();
    expect(model.gpuMemoryFreed(model.get('k1')!)).toBe(3 * GB);
    expect(model.summary.gpuMemoryFreed).toBe(7 * GB);
  });

  it('suspends: pending while the request runs, then the answer', async () => {
    await model.refresh();
    let release: () => void = () => undefined;
    const gate = new Promise<void>(resolve => (release = resolve));
    server.on('POST', 'kernels/k1/suspend', () => ({
      body: makeKernel({
        id: 'k1',
        state: 'suspended',
        tier: 'disk',
        checkpoint_bytes: 5 * GB,
        last_suspend_seconds: 0.2
      })
    }));
    const fetch = server.fetch;
    (model.serverSettings as any).fetch = async (
      input: RequestInfo,
      init?: RequestInit
    ) => {
      await gate;
      return fetch(input, init);
    };
    const done = model.suspend('k1');
    expect(model.isPending('k1')).toBe(true);
    expect(model.pendingAction('k1')).toBe('suspend');
    expect(model.get('k1')!.state).toBe('suspending');
    await expect(model.suspend('k1')).rejects.toBeInstanceOf(CedanaAPIError);
    release();
    const kernel = await done;
    expect(kernel.state).toBe('suspended');
    expect(model.isPending('k1')).toBe(false);
    expect(model.get('k1')!.checkpoint_bytes).toBe(5 * GB);
    expect(server.requests.some(r => r.path === 'kernels/k1/suspend')).toBe(
      true
    );
  });

  it("rejects with the server's reason and shows the kernel as it is", async () => {
    await model.refresh();
    server.on('POST', 'kernels/k2/resume', () => {
      kernels[1] = {
        ...kernels[1],
        state: 'failed',
        reason: 'checksum mismatch in pages-1.img'
      };
      return {
        status: 500,
        body: {
          code: 'checkpoint_corrupt',
          message: 'checksum mismatch in pages-1.img'
        }
      };
    });
    const failed = jest.fn();
    model.failed.connect(failed);
    const error = await model.resume('k2').catch(e => e);
    expect(error).toBeInstanceOf(CedanaAPIError);
    expect(error.message).toBe('checksum mismatch in pages-1.img');
    expect(error.code).toBe('checkpoint_corrupt');
    expect(model.get('k2')!.state).toBe('failed');
    expect(model.get('k2')!.reason).toBe('checksum mismatch in pages-1.img');
    expect(model.isPending('k2')).toBe(false);
    // Our own request reports its failure; the model does not repeat it.
    events.stream.emit({
      schema_id: EVENT_SCHEMA_ID,
      kernel_id: 'k2',
      action: 'failed',
      reason: 'late event'
    });
    expect(failed).toHaveBeenCalledTimes(1);
  });

  it('keeps a kernel awake', async () => {
    await model.refresh();
    server.on('POST', 'kernels/k1/keep-awake', request => {
      const seconds = JSON.parse(request.body).seconds;
      return {
        body: {
          ...kernels[0],
          keep_awake_until: new Date(
            Date.parse('2030-01-01T00:01:00Z') + seconds * 1000
          ).toISOString(),
          suspend_at: new Date(
            Date.parse('2030-01-01T00:01:00Z') + (seconds + 600) * 1000
          ).toISOString()
        }
      };
    });
    const before = model.secondsUntilSuspend(model.get('k1')!)!;
    await model.keepAwake('k1', 3600);
    const after = model.secondsUntilSuspend(model.get('k1')!)!;
    expect(after - before).toBeGreaterThan(3500);
    expect(model.keepAwakeSecondsLeft(model.get('k1')!)).toBeGreaterThan(3590);
  });

  it("counts down on the server's clock", async () => {
    // The server's now is last_activity + idle_seconds = 00:01:00; suspend
    // at 00:10:00 is 9 minutes away whatever the local clock says.
    await model.refresh();
    const left = model.secondsUntilSuspend(model.get('k1')!)!;
    expect(left).toBeGreaterThan(538);
    expect(left).toBeLessThanOrEqual(540);
    expect(model.secondsUntilSuspend(model.get('k2')!)).toBeNull();
    expect(model.idleSeconds(model.get('k1')!)).toBeGreaterThanOrEqual(60);
  });

  describe('events', () => {
    it('ignores other schemas', async () => {
      await model.refresh();
      const changed = jest.fn();
      model.changed.connect(changed);
      events.stream.emit({
        schema_id:
          'https://events.jupyter.org/jupyter_server/kernel_actions/v1',
        kernel_id: 'k1',
        action: 'suspended'
      });
      expect(changed).not.toHaveBeenCalled();
    });

    it('applies suspend and resume events at once', async () => {
      await model.refresh();
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'suspending',
        state: 'suspending',
        progress: { phase: 'dump', fraction: 0.5 }
      });
      expect(model.get('k1')!.state).toBe('suspending');
      expect(model.get('k1')!.progress!.fraction).toBe(0.5);
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'suspended',
        state: 'suspended',
        tier: 'disk',
        duration_seconds: 0.25,
        checkpoint_bytes: 2 * GB,
        gpu_memory_freed_bytes: 6 * GB
      });
      const kernel = model.get('k1')!;
      expect(kernel.state).toBe('suspended');
      expect(kernel.tier).toBe('disk');
      expect(kernel.progress).toBeNull();
      expect(kernel.last_suspend_seconds).toBe(0.25);
      expect(kernel.checkpoint_bytes).toBe(2 * GB);
      expect(model.gpuMemoryFreed(kernel)).toBe(6 * GB);
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'resumed',
        duration_seconds: 0.1
      });
      expect(model.get('k1')!.state).toBe('running');
      expect(model.get('k1')!.tier).toBeNull();
      expect(model.get('k1')!.last_resume_seconds).toBe(0.1);
      expect(model.eventsSeen).toBe(true);
    });

    it('shows what a failed lazy restore lost, and what the next resume says', async () => {
      await model.refresh();
      const lost =
        'The kernel failed while its memory was being restored, and was stopped: ' +
        'the page server stopped. What it did after its resume at ' +
        '2026-01-01T10:02:03+00:00 is lost; its checkpoint taken at ' +
        '2026-01-01T09:40:00+00:00 is kept, and the next resume goes back to it.';
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'failed',
        state: 'failed',
        reason: lost,
        lost_after: '2026-01-01T10:02:03+00:00'
      });
      expect(model.get('k1')!.state).toBe('failed');
      expect(model.get('k1')!.reason).toBe(lost);
      const back =
        'Resumed from its checkpoint taken at 2026-01-01T09:40:00+00:00: what it ' +
        'did after its resume at 2026-01-01T10:02:03+00:00 was lost';
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'resumed',
        state: 'running',
        reason: back,
        lost_after: '2026-01-01T10:02:03+00:00'
      });
      expect(model.get('k1')!.state).toBe('running');
      expect(model.get('k1')!.reason).toBe(back);
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'resumed',
        state: 'running'
      });
      expect(model.get('k1')!.reason).toBeNull();
    });

    it('refreshes the kernel from the server after an event', async () => {
      await model.refresh();
      kernels[0] = { ...kernels[0], state: 'suspended', tier: 'disk' };
      const before = server.requests.length;
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'suspended'
      });
      await sleep(50);
      const paths = server.requests.slice(before).map(r => r.path);
      expect(paths).toContain('kernels/k1');
      expect(model.get('k1')!.state).toBe('suspended');
    });

    it('reports failures that no request of ours caused', async () => {
      await model.refresh();
      sessions.add('train.ipynb', 'k2');
      const failed = jest.fn();
      model.failed.connect((_, failure) => failed(failure));
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k2',
        action: 'failed',
        state: 'failed',
        reason: 'CRIU restore failed: bad image'
      });
      expect(failed).toHaveBeenCalledWith({
        kernelId: 'k2',
        path: 'train.ipynb',
        message: 'CRIU restore failed: bad image'
      });
      expect(model.get('k2')!.state).toBe('failed');
      expect(model.get('k2')!.reason).toBe('CRIU restore failed: bad image');
    });

    it('shows a queued suspend until it starts, and where it waits', async () => {
      await model.refresh();
      kernels[0] = {
        ...kernels[0],
        queued: { action: 'suspend', position: 2, since: null }
      };
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'queued',
        state: 'running',
        reason: 'suspend'
      });
      // At once from the event, then the position from the server.
      expect(model.get('k1')!.state).toBe('running');
      expect(model.get('k1')!.queued!.action).toBe('suspend');
      await sleep(50);
      expect(model.get('k1')!.queued!.position).toBe(2);
      kernels[0] = { ...kernels[0], state: 'suspending', queued: null };
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k1',
        action: 'suspending',
        state: 'suspending'
      });
      expect(model.get('k1')!.queued).toBeNull();
      expect(model.get('k1')!.state).toBe('suspending');
    });

    it('forgets a queued suspend the policy dropped', async () => {
      await model.refresh();
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k3',
        action: 'queued',
        state: 'running',
        reason: 'suspend'
      });
      expect(model.get('k3')!.queued).not.toBeNull();
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k3',
        action: 'dequeued',
        state: 'running'
      });
      expect(model.get('k3')!.queued).toBeNull();
      expect(model.get('k3')!.state).toBe('running');
    });

    it('fetches a kernel it did not know', async () => {
      await model.refresh();
      kernels.push(makeKernel({ id: 'k4' }));
      events.stream.emit({
        schema_id: EVENT_SCHEMA_ID,
        kernel_id: 'k4',
        action: 'keep-awake'
      });
      await sleep(50);
      expect(model.get('k4')).toBeDefined();
    });
  });

  it('shows a suspended kernel as resuming when a cell runs', async () => {
    await model.refresh();
    model.noteExecution('k2');
    const kernel = model.get('k2')!;
    expect(kernel.state).toBe('resuming');
    expect(kernel.progress!.bytes_total).toBe(3 * GB);
    // A running kernel is left alone.
    model.noteExecution('k1');
    expect(model.get('k1')!.state).toBe('running');
    // The transitional refresh brings the server's state back.
    await sleep(50);
    expect(model.get('k2')!.state).toBe('suspended');
  });

  it('polls with back-off and pauses when hidden', () => {
    const frequency = model.poll.frequency;
    expect(frequency.interval).toBe(10000);
    expect(frequency.backoff).toBe(true);
    expect(model.poll.standby).toBe('when-hidden');
    model.refreshInterval = 3;
    expect(model.poll.frequency.interval).toBe(3000);
    model.refreshInterval = 0;
    expect(model.refreshInterval).toBe(1);
  });

  it('polls by itself once started', async () => {
    const polled = new CedanaModel({
      serverSettings: server.settings(),
      refreshInterval: 1
    });
    try {
      await sleep(100);
      expect(polled.loaded).toBe(true);
      expect(polled.kernels).toHaveLength(3);
    } finally {
      polled.dispose();
    }
  });

  it('stops listening when disposed', async () => {
    await model.refresh();
    model.dispose();
    expect(model.isDisposed).toBe(true);
    events.stream.emit({
      schema_id: EVENT_SCHEMA_ID,
      kernel_id: 'k1',
      action: 'suspended'
    });
    expect(model.get('k1')!.state).toBe('running');
  });
});
