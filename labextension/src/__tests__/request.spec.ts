import {
  CedanaAPIError,
  getKernel,
  getStatus,
  keepAwake,
  listKernels,
  requestAPI,
  resumeKernel,
  suspendKernel
} from '../request';
import { FakeServer, makeKernel, makeStatus } from './fakes';

describe('requestAPI', () => {
  let server: FakeServer;

  beforeEach(() => {
    server = new FakeServer();
  });

  it('calls /api/cedana under the base URL with the token', async () => {
    server.on('GET', 'kernels', () => ({ body: [makeKernel()] }));
    const kernels = await requestAPI<any[]>(
      'kernels',
      { method: 'GET' },
      server.settings()
    );
    expect(kernels).toHaveLength(1);
    expect(server.requests).toHaveLength(1);
    const request = server.requests[0];
    expect(request.method).toBe('GET');
    expect(request.path).toBe('kernels');
    expect(request.headers.get('Authorization')).toBe('token secret-token');
  });

  it("throws the server's code and message", async () => {
    server.on('POST', 'kernels/k1/suspend', () => ({
      status: 409,
      body: { code: 'conflict', message: 'Kernel k1 is busy: it runs code.' }
    }));
    const error = await suspendKernel('k1', {}, server.settings()).catch(
      e => e
    );
    expect(error).toBeInstanceOf(CedanaAPIError);
    expect(error.message).toBe('Kernel k1 is busy: it runs code.');
    expect(error.code).toBe('conflict');
    expect(error.status).toBe(409);
  });

  it('describes an error without a JSON body by its status', async () => {
    server.on('GET', 'status', () => ({
      status: 502,
      raw: '<html>bad</html>'
    }));
    const error = await getStatus(server.settings()).catch(e => e);
    expect(error).toBeInstanceOf(CedanaAPIError);
    expect(error.message).toBe('502 Error');
    expect(error.code).toBe('error');
  });

  it('turns a network failure into a CedanaAPIError', async () => {
    const settings = server.settings();
    (settings as any).fetch = () => Promise.reject(new TypeError('offline'));
    const error = await listKernels(settings).catch(e => e);
    expect(error).toBeInstanceOf(CedanaAPIError);
    expect(error.code).toBe('network_error');
    expect(error.message).toContain('offline');
  });

  it('accepts an empty answer', async () => {
    server.on('POST', 'kernels/k1/resume', () => ({ status: 202 }));
    await expect(
      resumeKernel('k1', {}, server.settings())
    ).resolves.toBeUndefined();
  });
});

describe('API functions', () => {
  let server: FakeServer;

  beforeEach(() => {
    server = new FakeServer();
    server
      .on('GET', 'kernels', () => ({ body: [makeKernel()] }))
      .on('GET', 'kernels/a b', () => ({ body: makeKernel({ id: 'a b' }) }))
      .on('GET', 'status', () => ({ body: makeStatus() }))
      .on('POST', 'kernels/k1/suspend', () => ({
        body: makeKernel({ state: 'suspended', tier: 'disk' })
      }))
      .on('POST', 'kernels/k1/resume', () => ({ body: makeKernel() }))
      .on('POST', 'kernels/k1/keep-awake', () => ({
        body: makeKernel({ keep_awake_until: '2030-01-01T01:00:00Z' })
      }));
  });

  it('lists kernels and reads the status', async () => {
    const settings = server.settings();
    expect((await listKernels(settings))[0].id).toBe('k1');
    expect((await getStatus(settings)).criu_version).toBe('4.2.1');
  });

  it('encodes the kernel id', async () => {
    const kernel = await getKernel('a b', server.settings());
    expect(kernel.id).toBe('a b');
    expect(server.requests[0].path).toBe('kernels/a b');
  });

  it('suspends with wait and tier in the query', async () => {
    const settings = server.settings();
    await suspendKernel('k1', {}, settings);
    expect(server.requests[0].method).toBe('POST');
    expect(server.requests[0].query.has('wait')).toBe(false);
    expect(server.requests[0].query.has('tier')).toBe(false);
    await suspendKernel('k1', { wait: false, tier: 'offload' }, settings);
    expect(server.requests[1].query.get('wait')).toBe('0');
    expect(server.requests[1].query.get('tier')).toBe('offload');
  });

  it('resumes without waiting when asked', async () => {
    await resumeKernel('k1', { wait: false }, server.settings());
    expect(server.requests[0].path).toBe('kernels/k1/resume');
    expect(server.requests[0].query.get('wait')).toBe('0');
  });

  it('keeps awake with a JSON body', async () => {
    const kernel = await keepAwake('k1', 3600, server.settings());
    expect(kernel.keep_awake_until).toBe('2030-01-01T01:00:00Z');
    const request = server.requests[0];
    expect(request.method).toBe('POST');
    expect(JSON.parse(request.body)).toEqual({ seconds: 3600 });
    expect(request.headers.get('Content-Type')).toBe('application/json');
  });
});
